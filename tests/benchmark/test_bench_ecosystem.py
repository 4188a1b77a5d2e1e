"""bench_load_memory and bench_generate on tiny shapes: the streamed-style output with random
factors loads through transformers' plugin, the CSV rows and PNG are written with the machine
named, and the generation benchmark times dense and compressed in one run."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

import panther_lite  # noqa: E402

TINY_SHAPE = (64, 128, 2, 4, 2, 100)  # hidden, intermediate, layers, heads, kv heads, vocab


def test_the_streamed_output_with_random_factors_loads_with_auto_model(tmp_path, load_script):
    bench = load_script("benchmarks/bench_load_memory.py")
    bench.SHAPES["tiny"] = TINY_SHAPE
    config = bench.llama_config("tiny", 0)
    written = bench.write_streamed_output(tmp_path / "out", config, 0.5)
    assert 0 < written <= bench._weights_bytes(tmp_path / "out")  # the files add their headers
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    sketched = [m for m in model.modules() if isinstance(m, panther_lite.SKLinear)]
    assert len(sketched) == 7 * config.num_hidden_layers
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 1 + config.num_hidden_layers


def test_load_memory_writes_its_rows_and_figure(tmp_path, load_script, monkeypatch):
    bench = load_script("benchmarks/bench_load_memory.py")
    monkeypatch.setitem(bench.SHAPES, "tinyllama", TINY_SHAPE)
    bench.main(["--layers", "1", "--loaders", "panther_lite", "--work-dir", str(tmp_path / "work"),
                "--output-dir", str(tmp_path / "results")])
    df = pd.read_csv(tmp_path / "results" / "load_memory_tinyllama.csv")
    assert list(df["output"]) == ["streamed", "in memory"] and (df["sketched_layers"] == 7).all()
    assert (df["peak_gb"] >= df["load_peak_gb"]).all() and (df["load_peak_gb"] >= df["imports_gb"]).all()
    assert df["machine"].str.contains("threads").all()
    assert (tmp_path / "results" / "load_memory_tinyllama.png").stat().st_size > 1000
    assert not (tmp_path / "work" / "tinyllama_1").exists()  # big temporary outputs are removed


def test_generate_times_dense_and_compressed_in_one_run(tmp_path, load_script, monkeypatch):
    bench = load_script("benchmarks/bench_generate.py")
    monkeypatch.setattr(bench, "SHAPE", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                             num_key_value_heads=2, vocab_size=100))
    bench.main(["--layers", "1", "--prompt", "8", "--new-tokens", "3", "--repeats", "2", "--threads", "1",
                "--clock", "cpu", "--output-dir", str(tmp_path)])
    df = pd.read_csv(tmp_path / "generate.csv")
    assert (df["clock"] == "cpu").all()
    with pytest.raises(SystemExit):  # CPU time adds up the threads' times: one thread only
        bench.parse_args(["--clock", "cpu", "--threads", "2"])
    assert sorted(zip(df["measure"], df["model"])) == [
        (measure, model) for measure in ("decode", "prefill") for model in ("compressed", "decode layout", "dense")]
    assert (df["runs"] == 2).all() and (df["min_s"] <= df["median_s"]).all() and (df["median_s"] <= df["max_s"]).all()
    assert (df["ratio"] > 1).all() and (df["target"] == 0.8 * df["ratio"]).all()
    assert (tmp_path / "generate.png").stat().st_size > 1000


def test_generate_converts_a_checkpoint_with_a_tied_lm_head(tmp_path, load_script):
    bench = load_script("benchmarks/bench_generate.py")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, tie_word_embeddings=True)
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(config)
    dense.save_pretrained(tmp_path / "tied")
    bench.main(["--model", "smollm2", "--model-dir", str(tmp_path / "tied"), "--prompt", "8", "--new-tokens", "3",
                "--repeats", "1", "--threads", "1", "--output-dir", str(tmp_path)])
    df = pd.read_csv(tmp_path / "generate_smollm2.csv")
    assert (df["dtype"] == "float32").all() and (df["param_ratio"] == 0.6).all() and (df["layers"] == 1).all()
    blocks = sum(p.numel() for p in dense.model.layers.parameters())
    embedding = dense.model.embed_tokens.weight.numel()  # stored once, multiplied once per token (lm_head)
    assert bench.stored_bytes(dense) == 4 * (blocks + embedding + dense.model.norm.weight.numel()) + sum(
        b.numel() * b.element_size() for b in dense.buffers())
    assert bench.matmul_flops_per_token(dense) == 2 * (blocks - 2 * 64 + embedding)  # the two norms are no matmul
    assert (df["ratio"] > 1).all() and (tmp_path / "generate_smollm2.png").stat().st_size > 1000
