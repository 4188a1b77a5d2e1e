"""benchmarks/validate_defaults.py: the text its defaults are chosen on is disjoint from every
benchmark's calibration and evaluation text, and choosing a share leaves the library's own."""
import pytest


def test_validation_text_shares_nothing_with_the_benchmarks_text(load_script):
    bench = load_script("benchmarks/validate_defaults.py")
    compression = load_script("benchmarks/bench_compression.py")
    validation, natural = bench._lines(bench.VALIDATION_SENTENCES), bench._lines(bench.NATURAL_SENTENCES)
    assert len(validation) >= 64 and len(set(validation)) == len(validation) and not set(validation) & set(natural)
    used = compression.CALIBRATION_SIZES["docstrings"] + compression.EVALUATION_DOCSTRINGS  # the most any bench reads
    docstrings = bench._docstring_sentences(bench.DOCSTRINGS.stop)
    held = docstrings[bench.DOCSTRINGS]
    assert bench.DOCSTRINGS.start >= used and len(held) == bench.DOCSTRINGS.stop - bench.DOCSTRINGS.start
    assert not set(held) & set(docstrings[:used])


def test_trying_a_share_restores_the_librarys_fraction_even_after_an_error(load_script, monkeypatch):
    bench = load_script("benchmarks/validate_defaults.py")
    from panther_lite.conversion.calibration import shrinkage

    default, seen = shrinkage.AUTO_FRACTION, []

    def failing(*args):
        seen.append(shrinkage.AUTO_FRACTION)
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(bench, "_ours", failing)
    monkeypatch.setattr(bench, "_batches", lambda tokenizer, text: [])
    validation = type("V", (), {"model": type("M", (), {"tokenizer": None})()})()
    with pytest.raises(RuntimeError, match="conversion failed"):
        bench.shrinkage_rows(validation)
    assert seen == [bench.FRACTIONS[0]] and shrinkage.AUTO_FRACTION == default
