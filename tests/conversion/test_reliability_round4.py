"""Round 4 of the reliability issues (issue 39): what a tampered or careless input did silently
wrong or with an error a user could not act on, on compress_checkpoint, from_pretrained,
ConvertConfig and the option checks; each now ends in a correct result or one line naming the
file, tensor, option or kind and what to do."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import panther_lite  # noqa: E402

VOCAB = 40
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:.*gradient_checkpointing")]


def _llama(layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32)).eval()  # fmt: skip


def _save(model, directory: Path, sharded: bool = False) -> Path:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(directory), **({"max_shard_size": "10KB"} if sharded else {}))
    finally:
        transformers_logging.enable_progress_bar()
    return directory


def _batches(count: int = 2, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [dict(input_ids=torch.randint(0, VOCAB, (2, 8), generator=generator),
                 attention_mask=torch.ones(2, 8, dtype=torch.long)) for _ in range(count)]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny LLaMA saved in several shards with their index (copy it before changing it)."""
    directory = _save(_llama(), tmp_path_factory.mktemp("sharded") / "model", sharded=True)
    assert len(list(directory.glob("*.safetensors"))) > 2
    return directory


def _index(directory: Path) -> dict:
    return json.loads((directory / "model.safetensors.index.json").read_text())


def _write_index(directory: Path, index: dict) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _compress(model_dir, output, **options):
    return panther_lite.compress_checkpoint(model_dir, output, calibration_data=_batches(), param_ratio=0.5,
                                            progress=False, **options)


# ----------------------------------------------------------------------- 1. paths an index names


@pytest.mark.parametrize("spelling", ["../outside.safetensors", "absolute"])
def test_an_index_naming_a_file_outside_model_dir_is_refused_before_it_is_read(spelling, sharded, tmp_path):
    model_dir = Path(shutil.copytree(sharded, tmp_path / "work" / "model"))
    index = _index(model_dir)
    moved_from = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "work" / "outside.safetensors"
    os.replace(model_dir / moved_from, outside)
    name = str(outside) if spelling == "absolute" else spelling
    index["weight_map"] = {key: (name if file == moved_from else file) for key, file in index["weight_map"].items()}
    _write_index(model_dir, index)
    with pytest.raises(ValueError, match=r"names the shard .*outside.safetensors.*outside .*model.*only name files inside"):
        _compress(model_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_linked_shard_file_inside_model_dir_still_streams(sharded, tmp_path):
    """A Hugging Face cache snapshot links each of its files to a blob elsewhere."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir(), snapshot.mkdir()
    for path in sharded.iterdir():
        shutil.copyfile(path, blobs / path.name)
        os.symlink(blobs / path.name, snapshot / path.name)
    report = _compress(snapshot, tmp_path / "out")
    assert report.attrs["pipeline"].startswith("out of core")


@pytest.fixture(scope="module")
def converted(sharded, tmp_path_factory) -> Path:
    """The sharded LLaMA compressed (a sharded output)."""
    output = tmp_path_factory.mktemp("converted") / "out"
    _compress(sharded, output)
    return output


def test_from_pretrained_refuses_an_output_whose_index_names_a_file_outside_it(converted, tmp_path):
    output = Path(shutil.copytree(converted, tmp_path / "out"))
    index = _index(output)
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copyfile(output / first, tmp_path / "elsewhere.safetensors")
    index["weight_map"] = {k: ("../elsewhere.safetensors" if v == first else v) for k, v in index["weight_map"].items()}
    _write_index(output, index)
    with pytest.raises(ValueError, match=r"names the shard '\.\./elsewhere\.safetensors', outside"):
        panther_lite.from_pretrained(transformers.AutoModelForCausalLM, output)


def _lie(path: Path, how: str) -> None:
    """Tamper with the safetensors file ``path``: truncate it, or make its header lie."""
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) - 100])
        return
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    name = next(key for key in header if key != "__metadata__")
    if how == "header size":
        path.write_bytes((size + 10**9).to_bytes(8, "little") + data[8:])
        return
    if how == "offsets":
        header[name]["data_offsets"][1] += 10**6
    elif how == "shape":
        header[name]["shape"] = [n * 2 for n in header[name]["shape"]]
    elif how == "dtype":
        header[name]["dtype"] = 9
    elif how == "dtype size":
        header[name]["dtype"] = "F64" if header[name]["dtype"] != "F64" else "F16"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + size :])


LIES = ["truncated", "header size", "offsets", "shape", "dtype", "dtype size"]


@pytest.mark.parametrize("how", LIES)
def test_a_truncated_or_lying_shard_is_an_error_naming_the_file(how, sharded, tmp_path):
    model_dir = Path(shutil.copytree(sharded, tmp_path / "model"))
    shard = sorted(model_dir.glob("model-*.safetensors"))[-1]
    _lie(shard, how)
    with pytest.raises(ValueError, match=rf"{shard.name}.*(truncated|tampered)"):
        _compress(model_dir, tmp_path / "out")


@pytest.mark.parametrize("how", LIES)
def test_from_pretrained_of_a_lying_output_names_the_file(how, converted, tmp_path):
    output = Path(shutil.copytree(converted, tmp_path / "out"))
    shard = sorted(output.glob("model-*.safetensors"))[0]
    _lie(shard, how)
    with pytest.raises(ValueError, match=rf"{shard.name}.*(truncated|tampered)"):
        panther_lite.from_pretrained(transformers.AutoModelForCausalLM, output)


def test_a_deeply_nested_save_record_is_a_one_line_error(converted, tmp_path):
    output = Path(shutil.copytree(converted, tmp_path / "out"))
    (output / "panther_lite_config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match="panther_lite_config.json.*nested too deeply"):
        panther_lite.from_pretrained(transformers.AutoModelForCausalLM, output)


def test_the_duplicate_layer_check_of_a_saved_record_is_linear():
    """60,000 entries, one name twice: a count per entry (quadratic) took tens of seconds; one pass a fraction of one."""
    import time

    from panther_lite import apply_conversion_config
    from panther_lite.conversion.saving.serialization import CONFIG_FORMAT, CONFIG_VERSION

    entry = dict(kind="SKLinear", shape=[8, 8], num_terms=1, low_rank=2, bias=True)
    layers = [dict(entry, name=f"layer{i}") for i in range(60_000)] + [dict(entry, name="0")] * 2
    config = dict(format=CONFIG_FORMAT, version=CONFIG_VERSION, layers=layers)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"lists \['0'\] more than once"):
        apply_conversion_config(torch.nn.Sequential(torch.nn.Linear(8, 8)), config)
    assert time.perf_counter() - started < 10


# --------------------------------------------------------------- 2. weights the config does not match


def _without(source: Path, directory: Path, dropped: str) -> Path:
    """``source`` (one safetensors file) copied without the tensor ``dropped``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors[dropped]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """A tiny three-layer LLaMA in one safetensors file."""
    return _save(_llama(layers=3), tmp_path_factory.mktemp("single") / "model")


@pytest.mark.parametrize("in_memory", [False, True], ids=["streamed", "in memory"])
@pytest.mark.filterwarnings("ignore:compress_checkpoint. loading")
def test_a_checkpoint_missing_a_tensor_is_an_error_naming_it(in_memory, single, tmp_path):
    model_dir = _without(single, tmp_path / "model", "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.down_proj\.weight.*"
                                         r"initialised at random.*allow_missing_weights=True"):
        _compress(model_dir, tmp_path / "out", in_memory=in_memory)
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_allow_missing_weights_fills_them_at_random_and_the_report_names_them(single, tmp_path):
    model_dir = _without(single, tmp_path / "model", "model.layers.1.mlp.down_proj.weight")
    with pytest.warns(UserWarning, match="initialised at random"):
        report = _compress(model_dir, tmp_path / "out", allow_missing_weights=True)
    assert report.attrs["random_weights"] == ["model.layers.1.mlp.down_proj.weight"]


@pytest.mark.parametrize("layers,message", [(4, r"lacks .*model\.layers\.3\."),
                                            (2, r"holds .* no place for .*model\.layers\.2\.")],
                         ids=["config says more layers", "config says fewer layers"])
@pytest.mark.filterwarnings("ignore:compress_checkpoint. loading")
def test_a_config_that_does_not_describe_the_weights_is_an_error(layers, message, single, tmp_path):
    model_dir = Path(shutil.copytree(single, tmp_path / "model"))
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    config.pop("layer_types", None)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        _compress(model_dir, tmp_path / "out")
    with pytest.raises(ValueError, match=message):
        _compress(model_dir, tmp_path / "out", in_memory=True)


# -------------------------------------------------------------------------- 4. option types


@pytest.mark.parametrize("option", ["overwrite", "in_memory", "resume", "allow_missing_weights"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_compress_checkpoint_flags_must_be_booleans(option, value, single, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(TypeError, match=rf"{option} must be True or False, got"):
        _compress(single, tmp_path / "out", **{option: value})
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"


def test_config_flags_must_be_booleans():
    import numpy as np

    with pytest.raises(TypeError, match="sequential must be True or False, got str 'no'"):
        panther_lite.ConvertConfig(param_ratio=0.5, sequential="no")
    with pytest.raises(TypeError, match="progress must be True or False"):
        panther_lite.ConvertConfig(param_ratio=0.5, progress="yes")
    assert panther_lite.ConvertConfig(param_ratio=0.5, sequential=np.bool_(True)).sequential is True


def test_a_configs_rank_pattern_is_a_read_only_copy():
    import copy
    import pickle

    pattern = {"up_proj": 0.3}
    config = panther_lite.ConvertConfig(param_ratio=0.5, rank_pattern=pattern)
    pattern["down_proj"] = 0.1  # the caller's dict: no effect on the config
    assert dict(config.rank_pattern) == {"up_proj": 0.3} and len(config.sizes.patterns) == 1
    with pytest.raises(TypeError, match="read-only"):
        config.rank_pattern["down_proj"] = 0.1
    with pytest.raises(TypeError, match="read-only"):
        config.rank_pattern.update(down_proj=0.1)
    assert pickle.loads(pickle.dumps(config)) == config == copy.deepcopy(config)
    assert json.dumps(config.rank_pattern) == '{"up_proj": 0.3}'


NUMPY_NUMBERS = ["float16", "float32", "float64", "longdouble"]


@pytest.mark.parametrize("dtype", NUMPY_NUMBERS)
def test_numpy_floats_of_every_dtype_are_numbers(dtype):
    import numpy as np

    config = panther_lite.ConvertConfig(param_ratio=np.dtype(dtype).type(0.5), rank_pattern={"x": np.dtype(dtype).type(0.25)})
    assert config.sizes.default == 0.5 and config.sizes.patterns[0][2] == 0.25


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"])
def test_numpy_ints_of_every_dtype_are_integers(dtype):
    import numpy as np

    value = np.dtype(dtype).type
    config = panther_lite.ConvertConfig(num_terms=value(1), low_rank=value(2), align=value(4), seed=value(3),
                                        runtime_rows=value(8))
    assert config.sizes.default == (1, 2) and config.runtime_rows == 8
    assert panther_lite.ConvertConfig(param_ratio=value(1)).sizes.default == 1.0


# ----------------------------------------------------------------------------- 3. resuming


def test_resuming_with_an_edited_filter_is_refused(single, tmp_path, stopped_after_first_block):
    first = lambda module, name: "mlp" in name  # noqa: E731
    with stopped_after_first_block():
        _compress(single, tmp_path / "out", filter_fn=first)
    edited = lambda module, name: "self_attn" in name  # noqa: E731  (the same qualname: <lambda>)
    with pytest.raises(ValueError, match=r"cannot resume .*other options \(filter_fn: "):
        _compress(single, tmp_path / "out", resume=True, filter_fn=edited)
    same = lambda module, name: "mlp" in name  # noqa: E731
    report = _compress(single, tmp_path / "out", resume=True, filter_fn=same)
    assert set(report[report["status"] == "converted"]["name"].str.contains("mlp")) == {True}


def test_a_filter_reading_a_changed_global_is_another_filter():
    from panther_lite.conversion.saving.resume_state import filter_fingerprint

    namespace = {"WANTED": ("mlp",)}
    exec("def keep(module, name):\n    return any(w in name for w in WANTED)\n", namespace)
    before, _ = filter_fingerprint(namespace["keep"])
    namespace["WANTED"] = ("self_attn",)
    after, _ = filter_fingerprint(namespace["keep"])
    assert before is not None and before != after


def test_resuming_with_a_filter_that_cannot_be_fingerprinted_is_refused_saying_why(single, tmp_path,
                                                                                   stopped_after_first_block):
    class Keep:
        def __call__(self, module, name):
            return "mlp" in name

    with stopped_after_first_block():
        _compress(single, tmp_path / "out", filter_fn=Keep())
    with pytest.raises(ValueError, match=r"cannot resume with this filter_fn: filter_fn is a Keep, not a plain Python "
                                         r"function.*delete"):
        _compress(single, tmp_path / "out", resume=True, filter_fn=Keep())


def test_the_run_record_stays_until_the_output_is_in_place(single, tmp_path, monkeypatch):
    """A kill after the run finished but before the rename: its staging directory still says what made it, so a
    resume against another checkpoint is refused rather than shipping the old shards under the new config."""
    from panther_lite.conversion.saving import staging

    def killed(staged, output):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(staging, "_move_into_place", killed)
        with pytest.raises(KeyboardInterrupt):
            _compress(single, tmp_path / "out")
    other = _save(_llama(layers=3, seed=1), tmp_path / "other")
    with pytest.raises(ValueError, match="cannot resume .*another checkpoint"):
        _compress(other, tmp_path / "out", resume=True)
    report = _compress(single, tmp_path / "out", resume=True)  # the same run finishes it
    assert (tmp_path / "out" / "config.json").is_file() and not (tmp_path / "out" / ".panther_lite_resume").exists()
    assert sorted(os.listdir(tmp_path)) == ["other", "out"] and report.attrs["pipeline"].startswith("out of core")


def test_a_staging_directory_with_files_but_no_record_is_not_resumed(single, tmp_path):
    from panther_lite.conversion.saving.staging import staging_path

    kept = staging_path(tmp_path / "out")
    kept.mkdir()
    (kept / "model-00001-of-00004.safetensors").write_bytes(b"old")
    with pytest.raises(ValueError, match="holds files but no record of the run"):
        _compress(single, tmp_path / "out", resume=True)
    assert (kept / "model-00001-of-00004.safetensors").read_bytes() == b"old"


# ------------------------------------------------------------------------------ 5. a full disk

_FULL_DISK = """
import resource, signal, sys, torch
import panther_lite
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over the limit fails with EFBIG instead of killing
generator = torch.Generator().manual_seed(1)
batches = [dict(input_ids=torch.randint(0, 40, (2, 8), generator=generator)) for _ in range(2)]
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
try:
    panther_lite.compress_checkpoint(sys.argv[1], sys.argv[2], calibration_data=batches, param_ratio=0.5,
                                     progress=False)
except OSError as error:
    print("OSError", error.errno, error)
"""


@pytest.mark.parametrize("limit", [2_000, 20_000])
def test_a_full_disk_is_an_oserror_naming_the_file(limit, single, tmp_path):
    import errno
    import subprocess
    import sys

    script = tmp_path / "full.py"
    script.write_text(_FULL_DISK)
    root = str(Path(panther_lite.__file__).parents[1])
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script), str(single), str(tmp_path / "out"), str(limit)],
                          capture_output=True, text=True, timeout=300, env=environment)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert last.startswith((f"OSError {errno.EFBIG} ", f"OSError {errno.ENOSPC} ")), last
    assert f"writing '{tmp_path}" in last and "free space there or write elsewhere" in last
    assert "no space left" in last or "over the size limit" in last


# ------------------------------------------------------------- 5. messages naming what to fix


def test_a_token_id_past_the_vocabulary_names_the_batch(single, tmp_path):
    batches = _batches(count=2)
    batches[1]["input_ids"][0, 3] = VOCAB + 7
    with pytest.raises(ValueError, match=rf"calibration batch 1 holds token id {VOCAB + 7}, past the model's "
                                         rf"vocabulary of {VOCAB} tokens.*model's own tokenizer"):
        panther_lite.compress_checkpoint(single, tmp_path / "out", calibration_data=batches, param_ratio=0.5,
                                         progress=False)
    with pytest.raises(ValueError, match="calibration batch 1 holds token id"):
        panther_lite.convert(_llama(), calibration_data=batches, param_ratio=0.5, progress=False)


class _Custom(torch.nn.Linear):
    pass


def _kind(**overrides):
    from panther_lite.conversion import LinearKind
    from panther_lite.nn import SKLinear

    built = type("BuiltCustom", (SKLinear,), {})
    kind = LinearKind("Custom", _Custom, built_type=built)
    for name, value in overrides.items():
        setattr(kind, name, value)
    return kind


@pytest.mark.parametrize("attribute", ["dense_type", "sketched_type", "built_type"])
def test_register_kind_refuses_a_type_that_is_not_a_class(attribute):
    from panther_lite.conversion.kinds import registered_kinds

    before = registered_kinds()
    with pytest.raises(TypeError, match=rf"layer kind 'Custom': {attribute} must be a class, got 'Linear'"):
        panther_lite.register_kind(_kind(**{attribute: "Linear"}))
    assert registered_kinds() == before
    report = panther_lite.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)), param_ratio=0.5, progress=False)
    assert list(report["status"]) == ["converted"]  # other conversions unaffected


@pytest.mark.parametrize("returned,message", [
    (lambda built, module: None, r"layer kind 'Custom': build\(\) returned NoneType for layer '0', expected a BuiltCustom"),
    (lambda built, module: built(8, 4, num_terms=1, low_rank=2), r"layer kind 'Custom': build\(\) made a layer of "
                                                                  r"weight shape \(4, 8\) for layer '0', whose weight is "
                                                                  r"\(16, 16\)"),
], ids=["None", "wrong shape"])
def test_a_kind_whose_build_is_wrong_is_named_with_the_layer(returned, message):
    from panther_lite.conversion.kinds import unregister_kind

    kind = _kind()
    kind.build = lambda module, num_terms, low_rank, **fit: returned(kind.built_type, module)
    panther_lite.register_kind(kind)
    try:
        with pytest.raises((TypeError, ValueError), match=message):
            panther_lite.convert(torch.nn.Sequential(_Custom(16, 16)), param_ratio=0.5, progress=False)
    finally:
        unregister_kind("Custom")


def test_the_command_reports_a_safetensors_error_on_one_line(monkeypatch, checkpoints, text_file, tmp_path, capsys):
    from safetensors import SafetensorError

    from panther_lite.cli import compress as command
    from panther_lite.cli import main

    def fails(*args, **kwargs):
        raise SafetensorError("Error while deserializing header: MetadataIncompleteBuffer")

    monkeypatch.setattr(command, "compress_checkpoint", fails)
    status = main(["compress", str(checkpoints["llama"]), "--calibration", str(text_file), "--output",
                   str(tmp_path / "out"), "--param-ratio", "0.5", "--quiet"])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith("error: Error while deserializing header: MetadataIncompleteBuffer")


def test_register_kind_replace_and_progress_flags_must_be_booleans():
    from panther_lite.conversion.progress import progress_bar

    with pytest.raises(TypeError, match="replace must be True or False, got str 'no'"):
        panther_lite.register_kind(_kind(), replace="no")
    with pytest.raises(TypeError, match="progress must be True or False"):
        progress_bar([1], "x", "y", "no")


def test_the_command_names_a_deeply_nested_config_json(checkpoints, text_file, tmp_path, capsys):
    from panther_lite.cli import main

    model_dir = Path(shutil.copytree(checkpoints["llama"], tmp_path / "model"))
    (model_dir / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    status = main(["compress", str(model_dir), "--calibration", str(text_file), "--output", str(tmp_path / "out"),
                   "--param-ratio", "0.5", "--quiet"])
    assert status == 1 and "config.json' is not a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["int16", "int64", "uint32"])
def test_sketch_sizes_take_numpy_integers(dtype):
    import numpy as np

    from panther_lite.sketch.hadamard import next_power_of_two

    assert next_power_of_two(np.dtype(dtype).type(5)) == 8
    linear = panther_lite.nn.SKLinear(np.dtype(dtype).type(8), np.dtype(dtype).type(6), num_terms=np.dtype(dtype).type(1),
                                      low_rank=np.dtype(dtype).type(2))
    assert linear(torch.randn(3, 8)).shape == (3, 6)


def test_the_command_names_missing_weights_and_its_option_allows_them(checkpoints, text_file, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from panther_lite.cli import main

    model_dir = Path(shutil.copytree(checkpoints["llama"], tmp_path / "model"))
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    argv = ["compress", str(model_dir), "--calibration", str(text_file), "--output", str(tmp_path / "out"),
            "--param-ratio", "0.5", "--quiet"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.up_proj.weight" in err and "--allow-missing-weights" in err
    assert not (tmp_path / "out").exists()
    assert main([*argv, "--allow-missing-weights"]) == 0
    assert "initialised at random" in capsys.readouterr().err and (tmp_path / "out" / "config.json").is_file()


def test_from_pretrained_names_an_output_config_json_too_deep_to_read(converted, tmp_path):
    output = Path(shutil.copytree(converted, tmp_path / "out"))
    (output / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match="config.json.*nested too deeply"):
        panther_lite.from_pretrained(transformers.AutoModelForCausalLM, output)


@pytest.mark.parametrize("manifest,message", [("[" * 200_000 + "]" * 200_000, "nested too deeply"),
                                              ("[1, 2]", "an unknown format")], ids=["deep", "a list"])
def test_a_tampered_resume_manifest_is_a_one_line_error(manifest, message, single, tmp_path, stopped_after_first_block):
    from panther_lite.conversion.saving.resume_state import RESUME_DIRECTORY
    from panther_lite.conversion.saving.staging import staging_path

    with stopped_after_first_block():
        _compress(single, tmp_path / "out")
    (staging_path(tmp_path / "out") / RESUME_DIRECTORY / "manifest.json").write_text(manifest)
    with pytest.raises(ValueError, match=message):
        _compress(single, tmp_path / "out", resume=True)
