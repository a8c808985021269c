"""The benchmark script runs end to end at tiny sizes, so it cannot rot. Timings here mean nothing.

The torch.compile configurations are left out (``--configs``): Inductor's C++ compile takes tens
of seconds per model on a 2-core CPU. They run in the real benchmark, ``python -m benchmarks.run``.
``--passes`` narrows optimize() to two passes to keep this test short.
"""
import json

import pytest
import torch

from benchmarks import run
from benchmarks.configs import Config, Setup
from benchmarks.measure import QUICK_GATE
from benchmarks.models import build_case
from benchmarks.results import CHART, JSON, MARKDOWN
from rewriter.decide.gate import host_page_faults
from rewriter.decide.knowledge import KnowledgeBase

pytest.importorskip("transformers")

MODELS = ["transposed_linear", "gpt2"]
CONFIGS = ["eager", "optimize", "expert", "expert_autocast"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    status = run.main(["--quick", "--models", ",".join(MODELS), "--mode", "train",
                       "--configs", ",".join(CONFIGS), "--passes", "fuse_attention,fuse_linear",
                       "--out", str(out)])
    return status, out, json.loads((out / JSON).read_text())


def test_every_row_ran(quick_run):
    status, _, data = quick_run
    rows = data["rows"]
    assert [(r["model"], r["config"]) for r in rows] == [(m, c) for m in MODELS for c in CONFIGS]
    assert [r["error"] for r in rows] == [None] * len(rows)
    assert status == 0
    for r in rows:
        assert r["speedup"] > 0 and r["pairs"] >= 3 and r["step_ms"] > 0 and r["eager_ms"] > 0
        assert r["first_step_s"] > 0 and r["peak_mb"] is not None
        if host_page_faults() is not None:  # counted where the host counts them (Linux)
            assert set(r["faults"]) == {"eager", "config"} and min(r["faults"].values()) >= 0


def test_numerics_against_eager(quick_run):
    by = {(r["model"], r["config"]): r for r in quick_run[2]["rows"]}
    for model in MODELS:
        assert by[model, "eager"]["rel_error"] == 0          # same weights, same input, same code
        assert by[model, "optimize"]["rel_error"] < 1e-4     # fp32 rewrites: rounding only
        assert by[model, "expert"]["rel_error"] < 1e-4
        assert 0 < by[model, "expert_autocast"]["rel_error"] < 5e-2   # bf16 by design
    opt = by["gpt2", "optimize"]
    assert opt["optimize_s"] > 0 and opt["profile_s"] is None  # --quick: profile off
    assert [d["pass"] for d in opt["decisions"]][:2] == ["fuse_attention", "fuse_linear"]


def test_markdown_has_machine_tables_and_reading(quick_run):
    _, out, data = quick_run
    md = (out / MARKDOWN).read_text()
    assert data["machine"]["cpu"] and data["machine"]["torch"] in md
    for heading in ("## Machine", "## Method", "speedup over eager", "## Reading"):
        assert heading in md
    for model in MODELS:
        assert f"### {model}" in md
    for label in ("eager fp32", "optimize()", "expert", "expert + autocast bf16"):
        assert f"| {label} |" in md
    assert "| page faults a step |" in md
    # the computed reading: each configuration's geomean, optimize() against the best peer
    assert "geometric mean over 2 model(s)" in md and "optimize() against the best peer" in md


def test_the_run_says_which_knowledge_base_optimize_read(quick_run, tmp_path, monkeypatch,
                                                          tmp_path_factory):
    _, out, data = quick_run
    assert "knowledge base: " + data["settings"]["knowledge_base"] in (out / MARKDOWN).read_text()
    # a module-scoped run too keeps out of the user's knowledge base (the session's, conftest)
    assert data["settings"]["knowledge_base"].startswith(str(tmp_path_factory.getbasetemp()))
    path = tmp_path / "kb.json"
    monkeypatch.setenv("REWRITER_KNOWLEDGE_BASE", str(path))
    assert run._knowledge_base_state() == f"{path}: empty at the start"
    kb = KnowledgeBase(str(path))
    kb.put("a", {"kept": True})
    kb.put("b", {"kept": False})
    kb.save()
    assert run._knowledge_base_state() == f"{path}: 2 decision(s) from earlier runs at the start"
    monkeypatch.setenv("REWRITER_KNOWLEDGE_BASE", "off")
    assert run._knowledge_base_state().startswith("off")


def test_optimize_seconds_say_how_much_was_profiling():
    from benchmarks.results import Row, _optimize_s
    row = Row(model="m", mode="train", config="optimize", label="optimize()", optimize_s=24.61,
              profile_s=8.04)
    assert _optimize_s(row) == "24.6 (8.0 profiling)"
    assert _optimize_s(Row(model="m", mode="train", config="eager", label="eager")) == "-"


def test_chart(quick_run):
    pytest.importorskip("matplotlib")
    _, out, _ = quick_run
    assert (out / CHART).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failing_configuration_is_a_row_not_a_crash():
    case = build_case("transposed_linear", quick=True, training=True)

    def broken(setup):
        raise RuntimeError("no such backend")
    row = run.run_config(Config("broken", "broken", broken), Setup(case, case.model, True, quick=True),
                         "train", lambda: None, case.model(*case.inputs), QUICK_GATE)
    assert row.error == "RuntimeError: no such backend" and row.speedup is None


def test_unknown_names_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        run.parse_args(["--models", "gpt3", "--out", str(tmp_path)])


def test_the_extra_families_run_on_request_only(tmp_path):
    assert run.parse_args(["--out", str(tmp_path)]).models == ["gpt2", "bert", "llama", "convnet",
                                                              "onehot_mlp", "transposed_linear"]
    assert run.parse_args(["--models", "qwen2,distilbert", "--out", str(tmp_path)]).models == [
        "qwen2", "distilbert"]
    for name, cls in (("qwen2", "Qwen2ForCausalLM"), ("distilbert", "DistilBertForMaskedLM"),
                      ("mistral", "MistralForCausalLM"), ("phi3", "Phi3ForCausalLM"),
                      ("gpt_neox", "GPTNeoXForCausalLM"), ("roberta", "RobertaForMaskedLM"),
                      ("llama_32k", "LlamaForCausalLM")):
        case = build_case(name, quick=True, training=True)
        expert, inputs = case.make_expert(case.model)
        assert type(case.model).__name__ == cls and case.model.config._attn_implementation == "eager"
        assert expert.config._attn_implementation == "sdpa"
        out, ref = case.model(**inputs), expert(**inputs)  # same weights: the same loss
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("held_out", ["_HELDOUT_4", "_HELDOUT_5"])
def test_the_fourth_and_fifth_held_out_families_build_and_their_expert_form_computes_the_same_loss(held_out):
    import benchmarks.models
    for name, (cls, _) in getattr(benchmarks.models, held_out).items():
        case = build_case(name, quick=True, training=True)
        expert, inputs = case.make_expert(case.model)
        out, ref = case.model(**inputs), expert(**inputs)
        assert type(case.model).__name__ == cls and torch.isfinite(out.loss), name
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5, msg=name)


def test_a_model_that_cannot_be_built_is_rows_with_its_error(tmp_path, monkeypatch):
    def no_model(name, **kw):
        raise ImportError("no transformers here")
    monkeypatch.setattr(run, "build_case", no_model)
    status = run.main(["--quick", "--models", "gpt2", "--configs", "eager,optimize", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / JSON).read_text())["rows"]
    assert status == 1 and [r["config"] for r in rows] == ["eager", "optimize"]
    assert all("ImportError: no transformers here" in r["error"] for r in rows)
    assert "Not built" in (tmp_path / MARKDOWN).read_text()


def test_the_decisions_table_says_what_repeated_and_what_depth_costs():
    from benchmarks.decisions import FEWEST_WHOLE_STEPS, to_markdown
    run = {"seconds": 10.0, "phases": {"capture": 4.0, "confirm": 2.0}, "decisions": {"fuse_attention": ["abcd1234"]},
           "reasons": {"fuse_attention": "faster"}, "final": ""}
    other = dict(run, decisions={"fuse_attention": []})

    def depth_run(rep, four, sixteen, after):
        return [dict(run, seconds=four, layers=4, kb="afresh", rep=rep),
                dict(run, seconds=sixteen, layers=16, kb="afresh", rep=rep),
                dict(run, seconds=sixteen - 1, layers=4, kb="knowledge base", rep=rep),
                dict(run, seconds=after, layers=16, kb="knowledge base, after 4 layers", rep=rep)]
    result = {"command": "python -m benchmarks.decisions", "machine": {"cpu": "test cpu"},
              "rows": [{"model": "gpt2", "precision": "fp32", "kb": "afresh", "runs": [run, other], "same": False}],
              "scaling": depth_run(1, 10.0, 25.0, 15.0) + depth_run(2, 20.0, 30.0, 24.0)
              + depth_run(3, 8.0, 24.0, 16.0),
              "floors": [{"4": {"trace": 4.0, "step": 0.5}, "16": {"trace": 11.0, "step": 1.3}},
                         {"4": {"trace": 4.0, "step": 0.5}, "16": {"trace": 5.0, "step": 0.6}},
                         {"4": {"trace": 2.0, "step": 0.25}, "16": {"trace": 3.0, "step": 0.75}}],
              "load": []}
    md = to_markdown(result)
    assert "| gpt2 | fp32 | afresh | 2 | **no** | 10.0 (10.0-10.0) | 4.0 |" in md
    assert "### gpt2 fp32 (afresh): decisions per run" in md
    assert "— test cpu (ISA unknown)," in md
    assert "| 2 | 16 | knowledge base, after 4 layers | 24.0 |" in md
    # each depth run against its own 4-layer run. Floors: afresh, that run plus the trace's growth
    # plus six other runs of the whole model at the eager step's growth; after 4, the 16-layer
    # trace and six 16-layer steps; both over the 4-layer run
    assert FEWEST_WHOLE_STEPS == 6  # the reference, the verification, two pairs
    # (10 + 7 + 6 * 0.8) / 10; (11 + 6 * 1.3) / 10
    assert "| 1 | 2.50x | 2.18x | 1.50x | 1.88x | 4.0 / 11.0 | 500 / 1300 |" in md
    # (20 + 1 + 6 * 0.1) / 20; (5 + 6 * 0.6) / 20
    assert "| 2 | 1.50x | 1.08x | 1.20x | 0.43x | 4.0 / 5.0 | 500 / 600 |" in md
    # (8 + 1 + 6 * 0.5) / 8; (3 + 6 * 0.75) / 8
    assert "| 3 | 3.00x | 1.50x | 2.00x | 0.94x | 2.0 / 3.0 | 250 / 750 |" in md
    assert "Median of 3 depth runs, 16 / 4 layers, afresh: 2.50x" in md
    assert "Median of 3 depth runs, 16 after 4 (knowledge base) / 4 afresh: 1.50x" in md
    assert md.count("Median of 3 depth runs, its floor:") == 2
    assert "Median of 3 depth runs, its floor: 1.50x" in md and "its floor: 0.94x" in md
    assert "comes within 1.5x of that 4-layer run only by deciding faster" in md


def test_a_depth_run_without_its_floor_says_so():
    from benchmarks.decisions import to_markdown
    run = {"seconds": 10.0, "phases": {}, "decisions": {}, "reasons": {}, "final": ""}
    result = {"command": "c", "machine": {}, "rows": [], "load": [],
              "scaling": [dict(run, layers=4, kb="afresh"), dict(run, seconds=15.0, layers=16, kb="afresh")]}
    md = to_markdown(result)
    assert "| 1 | 1.50x | - | - | - | - | - |" in md and "Median of" not in md


@pytest.mark.parametrize("isa, text", [
    ({"avx512": True, "avx512_bf16": True, "amx_bf16": False}, "avx512, avx512_bf16"),
    ({"avx512": False, "avx512_bf16": False, "amx_bf16": False}, "no avx512, no avx512_bf16, no amx_bf16"),
    ({}, "ISA unknown")])
def test_the_machine_line_names_the_isa_it_has_or_lacks(isa, text):
    from benchmarks.measure import isa_text
    assert isa_text({"isa": isa}) == text


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_attention_parts_times_both_forms_forward_and_training(capsys, dtype):
    from benchmarks import attention_parts
    assert attention_parts.main(["--batch", "1", "--heads", "2", "--seq", "16", "--dim", "8",
                                 "--repeat", "1", "--quick", "--dtype", dtype]) == 0
    out = capsys.readouterr().out
    assert f"1 x 2 heads x 16 x 8, {dtype}, causal" in out
    assert "1. forward: written" in out and "1. forward + backward: written" in out


def test_the_two_attention_forms_compute_the_same():
    import torch

    from benchmarks.attention_parts import forms
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    f = forms(2, 3, 16, 8)
    # fp32, sums over 16 keys and 8 dims: the default fp32 tolerances hold
    torch.testing.assert_close(f["written"](q, k, v), f["sdpa"](q, k, v))


def test_in_bf16_both_attention_forms_run_in_bf16_and_agree_to_its_rounding():
    import torch

    from benchmarks.attention_parts import forms
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, dtype=torch.bfloat16) for _ in range(3))
    f = forms(2, 3, 16, 8, torch.bfloat16)
    written, sdpa = f["written"](q, k, v), f["sdpa"](q, k, v)
    assert written.dtype == sdpa.dtype == torch.bfloat16
    # both take the softmax in float32; the written form rounds the scores and the
    # probabilities to bf16 (8 bits of mantissa, 2**-8 relative) before its two GEMMs, over 8
    # dims and 16 keys: a few bf16 roundings of values of size ~1
    torch.testing.assert_close(written.float(), sdpa.float(), rtol=2 ** -6, atol=2 ** -6)
    # and in float32 the forms are the ones the fp32 test compares
    f32 = forms(2, 3, 16, 8)
    torch.testing.assert_close(written.float(), f32["written"](q.float(), k.float(), v.float()),
                               rtol=2 ** -6, atol=2 ** -6)


def test_the_regional_table_compares_depth_with_its_floor_and_torch_compile():
    from benchmarks.regional import to_markdown

    def opt(layers, seconds, regional=True):
        return {"layers": layers, "regional": regional, "seconds": seconds, "capture_s": 2.0,
                "graphs": 5 if regional else 1, "block_graphs": 1 if regional else 0,
                "kept": ["fuse_optimizer"], "sites": {"fuse_rms_norm": 9},
                "statuses": {"fuse_rms_norm": "rejected"}, "phases": {}, "final": ""}
    result = {"command": "python -m benchmarks.regional", "machine": {"cpu": "test cpu", "cpu_count": 2},
              "depth": [{"layers": 4, "regional": opt(4, 10.0), "whole": opt(4, 9.0, False),
                         "eager_step_s": 0.25, "floor_s": 1.5},
                        {"layers": 16, "regional": opt(16, 14.0), "whole": opt(16, 20.0, False),
                         "eager_step_s": 1.0, "floor_s": 6.0, "compile_first_step_s": 70.0}],
              "checkpointing": {"off": opt(4, 10.0), "on": opt(4, 11.0)}}
    md = to_markdown(result)
    assert "| 16 | regional | 14.0 | 2.0 | 5 | 1 | fuse_optimizer | 6.0 | 70.0 |" in md
    assert "| 16 | whole | 20.0 | 2.0 | 1 | 0 | fuse_optimizer | 6.0 |  |" in md
    # the 4-layer run plus the floor's growth (6.0 - 1.5); against torch.compile's first step
    assert "growth of the fixed whole-model runs (4.50 s): 14.50 s." in md
    assert "14.0 / 70.0 = 0.20." in md
    assert "| fuse_rms_norm | 9 | rejected | 9 | rejected |" in md


def test_the_generation_table_gives_speedups_rates_and_what_optimize_decided():
    from benchmarks.generate import NEW_TOKENS, _decode_rate, markdown
    row = {"config": "optimize", "what": "rewriter.optimize() defaults", "one_time_s": 12.0,
           "new_length_first_call_s": 0.21, "tokens_equal_to_eager": "48/48", "prefill_speedup": 1.1,
           "prefill_noise": 0.02, "generate_speedup": 0.99, "generate_noise": 0.01,
           "eager_prefill_tok_s": 900.0, "prefill_tok_s": 990.0, "eager_decode_tok_s": 280.0,
           "decode_tok_s": 277.0, "kept": [], "workload": "generate: a prefill", "whole_model": "slower",
           "block_graphs": [["B.graph_0", "B.graph_1"]], "cold_one_time_s": None}
    serving = {**row, "config": "optimize_serving", "one_time_s": 9.0, "cold_one_time_s": 20.5}
    result = {"machine": {"cpu": "test cpu", "isa": {}, "cpu_count": 2, "torch": "2.13", "transformers": "5",
                          "date": "today", "load_average_at_start": 0.1},
              "dtype": "float32", "model": "tiny", "rows": [row, serving]}
    md = markdown(result, "python -m benchmarks.generate")
    assert "| optimize | 12.0 | - | 0.21 | 48/48 | 1.1x ±0.02 | 0.99x ±0.01 | 990.0 (900.0) | 277.0 (280.0) |" in md
    assert "| optimize_serving | 9.0 | 20.5 | 0.21 |" in md
    assert "- optimize: step: generate: a prefill; kept: nothing; whole model: slower; compile: no row" in md
    # 47 further tokens in the 470 ms a 48-token call takes beyond a 1-token one
    assert _decode_rate(520.0, 50.0) == round((NEW_TOKENS - 1) / 0.47, 1)
    assert _decode_rate(50.0, 50.0) is None


def test_the_fsdp_table_gives_each_rank_its_kept_rewrites_and_loss_difference():
    from benchmarks.fsdp import to_markdown

    def rank(r, order, kept):
        return {"rank": r, "seconds": 7.0 + r, "kept": kept, "runs": "rewritten blocks and outer graphs",
                "block_graph_runs": 16, "losses": [9.0, 8.5], "eager_losses": [9.0, 8.5 + 1e-6],
                "statuses": {"fuse_attention": "kept" if r == 0 else "replayed"}, "notes": [], "final": ""}
    result = {"command": "python -m benchmarks.fsdp", "machine": {"cpu": "test cpu", "cpu_count": 2},
              "layers": 4, "steps": 2,
              "plain": {"seconds": 6.5, "kept": ["fuse_attention", "fuse_optimizer"],
                        "statuses": {"fuse_attention": "kept"}},
              "optimize_then_shard": [rank(0, "o", ["fuse_attention", "fuse_optimizer"]),
                                      rank(1, "o", ["fuse_attention", "fuse_optimizer"])],
              "shard_then_optimize": [rank(0, "s", ["fuse_attention"]), rank(1, "s", ["fuse_attention"])]}
    md = to_markdown(result)
    assert "| plain (no process group) | - | 6.5 | fuse_attention, fuse_optimizer | - | - | - |" in md
    assert ("| shard then optimize | 1 | 8.0 | fuse_attention | rewritten blocks and outer graphs | 16 | "
            "1.00e-06 |") in md
    assert "LLaMA config, 4 layers" in md and "2 steps" in md


def test_the_families_sweep_runs_and_reports_a_family(tmp_path):
    """benchmarks/families.py end to end on one family: its row says how it was captured, and
    the optimized model trains and generates as the original."""
    from benchmarks import families
    assert families.main(["--only", "LlamaConfig", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "families.json").read_text())["rows"]
    assert row["error"] is None and row["capture"] == "regional" and row["graphs"] > 1
    assert row["max_loss_difference"] < 1e-4 and row["generate_tokens_equal"] == f"{families.NEW_TOKENS}/{families.NEW_TOKENS}"
    assert "| Llama | regional |" in (tmp_path / "FAMILIES.md").read_text()
    with pytest.raises(SystemExit):
        families.main(["--only", "NoSuchConfig"])


def test_the_decode_graphs_table_names_each_familys_graphs_calls_and_failures():
    from benchmarks.decode_graphs import markdown
    result = {"command": "python -m benchmarks.decode_graphs", "machine": {
        "cpu": "test cpu", "isa": {}, "cpu_count": 2, "torch": "2.13", "transformers": "5", "date": "today"},
        "rows": [{"family": "LlamaConfig", "graphs_first": 1, "graphs_after_new_length": 1,
                  "compiled_calls_first": 7, "compiled_calls": 11, "tokens_equal": True},
                 {"family": "OddConfig", "error": "TypeError: no"}]}
    md = markdown(result)
    assert "| LlamaConfig | 1 | 1 | 7, 11 | True |" in md
    assert "| OddConfig | raised: TypeError: no | | | |" in md
    assert md.startswith("# Decode graphs per family\n\n`python -m benchmarks.decode_graphs` — test cpu")
    assert "What: Each causal family of ``benchmarks.families``" in md


def test_cold_one_time_costs_are_rows_and_a_failed_process_is_a_row_with_its_error(monkeypatch):
    """Each configuration's one-time cost comes from a process of its own (an empty Inductor
    cache and knowledge base in its environment); one that fails is a row saying why."""
    import subprocess
    import types

    from benchmarks import cold_one_time

    seen = []

    def fake_run(cmd, env, capture_output, text):
        seen.append(env)
        if cmd[-2:] == ["bert", "compile"]:
            return types.SimpleNamespace(returncode=1, stdout="", stderr="Traceback\nRuntimeError: no g++")
        return types.SimpleNamespace(returncode=0, stderr="", stdout=json.dumps(
            {"model": cmd[-2], "config": cmd[-1], "one_time_s": 12.5, "optimize_s": 12.0,
             "first_step_s": 0.5, "kept": ["kept: fuse_optimizer, compile"]}))

    monkeypatch.setattr(subprocess, "run", fake_run)
    rows = [cold_one_time.cold("bert", c, quick=False) for c in ("compile", "optimize_steps20k")]
    assert all("inductor" in e["TORCHINDUCTOR_CACHE_DIR"] and e["REWRITER_KNOWLEDGE_BASE"] for e in seen)
    assert seen[0]["TORCHINDUCTOR_CACHE_DIR"] != seen[1]["TORCHINDUCTOR_CACHE_DIR"]  # none shared
    assert "no g++" in rows[0]["error"] and rows[1]["one_time_s"] == 12.5
    text = cold_one_time.markdown(rows, "python -m benchmarks.cold_one_time", {"cpu": "X", "isa": {}})
    assert "| bert | compile | failed |" in text and "RuntimeError: no g++" in text
    assert "| bert | optimize_steps20k | 12.5 | 12.0 | 0.5 | kept: fuse_optimizer, compile |" in text
    cmds = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: cmds.append(cmd) or types.SimpleNamespace(
        returncode=1, stdout="", stderr="stopped here"))
    cold_one_time.cold("llama", "compile", quick=False, layers=8)
    assert cmds[0][-4:] == ["llama", "compile", "--layers", "8"]


def test_compile_families_rows_come_from_fresh_processes_and_give_the_compile_verdict(monkeypatch):
    """Each family is optimized in a process of its own (an empty Inductor cache in its
    environment); its row gives the tried compile's verdict, a process that fails is a row with
    its error, and a family the module does not size is refused."""
    import subprocess
    import types

    from benchmarks import compile_families

    seen = []
    kept = {"family": "Qwen2", "capture": "regional", "kept": ["fuse_optimizer", "compile"],
            "compile": [{"status": "kept", "speedup": 1.153, "reason": "inductor, whole step: faster"},
                        {"status": "not tried", "speedup": None, "reason": "the regional compile is the candidate"}],
            "optimize_s": 30.4, "compile_s": 19.6, "failed": []}

    def fake_run(cmd, env, capture_output, text):
        seen.append((cmd, env))
        if cmd[-1] == "OPTConfig":
            return types.SimpleNamespace(returncode=1, stdout="", stderr="Traceback\nRuntimeError: no g++")
        return types.SimpleNamespace(returncode=0, stderr="", stdout=json.dumps(kept))

    monkeypatch.setattr(subprocess, "run", fake_run)
    rows = [compile_families.cold(n) for n in ("Qwen2Config", "OPTConfig")]
    assert [c[0][-2:] for c in seen] == [["--one", "Qwen2Config"], ["--one", "OPTConfig"]]
    assert seen[0][1]["TORCHINDUCTOR_CACHE_DIR"] != seen[1][1]["TORCHINDUCTOR_CACHE_DIR"]  # none shared
    text = compile_families.markdown(rows, "python -m benchmarks.compile_families", {"cpu": "X", "isa": {}})
    assert "| Qwen2 | regional | kept 1.153x | fuse_optimizer, compile | 30.4 | 19.6 | - |" in text
    assert "| OPT | failed |" in text and "RuntimeError: no g++" in text
    assert compile_families._compile_cell(
        [{"status": "not tried", "speedup": None, "reason": "would not repay within the run"}]
    ) == "not tried: would not repay within the run"
    with pytest.raises(SystemExit):
        compile_families.main(["--only", "NoSuchConfig"])
    seen.clear()
    compile_families.cold("Qwen2Config", bf16=True)
    assert seen[0][0][-3:] == ["--one", "Qwen2Config", "--bf16"]
    assert "dtype=torch.bfloat16" in compile_families.markdown(rows, "c", {"cpu": "X", "isa": {}}, bf16=True)


def test_the_cross_entropy_benchmark_runs(capsys):
    from benchmarks import cross_entropy
    assert cross_entropy.main(["--rows", "8", "--classes", "16", "--rounds", "1", "--pairs", "6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Machine: ") and "round 1: " in out and "x ±" in out
    assert cross_entropy.main(["--rows", "8", "--classes", "16", "--rounds", "1", "--pairs", "6",
                               "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "bf16 logits" in out and "F.cross_entropy(logits.float())" in out and "round 1: " in out


def test_cold_one_time_rounds_alternate_the_order_and_give_the_median_of_each_rounds_ratio(monkeypatch, tmp_path):
    """``--repeat``: a cold process's seconds drift; each round runs the pair back to back, in
    alternating order, and the figure is the median of the rounds' own ratios."""
    from benchmarks import cold_one_time

    times = iter([30.0, 33.0, 36.0, 30.0, 31.0, 31.0])  # rounds: peer ours | ours peer | peer ours
    order = []

    def fake_cold(model, config, quick, layers=None):
        order.append(config)
        return {"model": model, "config": config, "one_time_s": next(times), "optimize_s": None,
                "first_step_s": 0.1, "kept": []}
    monkeypatch.setattr(cold_one_time, "cold", fake_cold)
    monkeypatch.setattr("benchmarks.measure.machine_info", lambda: {"cpu": "X", "isa": {}})
    assert cold_one_time.main(["--models", "gpt2", "--configs", "compile", "optimize_steps20k",
                               "--repeat", "3", "--out", str(tmp_path)]) == 0
    assert order == ["compile", "optimize_steps20k", "optimize_steps20k", "compile", "compile",
                     "optimize_steps20k"]
    text = (tmp_path / "COLD_ONE_TIME.md").read_text()
    # optimize over compile, round by round: 33/30 = 1.1, 36/30 = 1.2, 31/31 = 1.0
    assert "| gpt2 | 30.00 (30.00-31.00) | 33.00 (31.00-36.00) | 1.100x (1.000-1.200) |" in text, text
    assert "| gpt2, round 2 | optimize_steps20k | 36.0 |" in text
