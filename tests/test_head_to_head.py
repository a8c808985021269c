"""benchmarks.head_to_head's table: ours against each peer, and a model whose process failed."""
from benchmarks.head_to_head import markdown, parse_args

MACHINE = {"cpu": "AMD EPYC", "cpu_count": 2, "torch": "2.13.0+cpu", "date": "2026-12-07"}


def test_the_table_gives_ours_over_each_peer_and_says_which_model_failed():
    results = [{"model": "llama", "ours": "optimize_steps20k", "kept": ["kept: fuse_attention"],
                "rows": [{"peer": "compile", "speedup": 1.0873, "noise": 0.0213, "pairs": 10,
                          "peer_ms": 279.5, "ours_ms": 257.1}]},
               {"model": "gpt2", "ours": "optimize_steps20k", "error": "RuntimeError: out of memory"}]
    text = markdown(results, "python -m benchmarks.head_to_head", MACHINE)
    assert "| llama | optimize(steps=20000) | torch.compile | **1.09x** ±0.02 | 10 | 279.5 | 257.1 |" in text
    assert "| gpt2 | optimize(steps=20000) | - | failed: RuntimeError: out of memory |" in text


def test_the_defaults_are_the_five_in_fp32_against_both_peers():
    args = parse_args([])
    assert args.ours == "optimize_steps20k" and args.peers == ["compile", "expert"]
    assert args.models == ["llama", "gpt2", "bert", "qwen2", "distilbert"]
