"""Real tokens only: positions an attention_mask marks as padding enter no statistic (Grams,
spectra, sequential statistics, refinement losses), and the report counts the real rows."""
import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.conversion.calibration.batches import CalibrationData
from panther_lite.conversion.calibration.grams import collect_grams
from panther_lite.conversion.kinds import kind_of
from panther_lite.conversion.kinds.strategy import new_record

VOCAB, WIDTH = 40, 12


class Block(nn.Module):
    """Position-wise (no mixing across tokens), so a real token's output never depends on padding."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, hidden, attention_mask=None):
        return hidden + self.down(torch.tanh(self.up(hidden)))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, WIDTH)
        self.pooled = nn.Linear(WIDTH, WIDTH)  # reads one vector per sequence: not aligned with the tokens

    def forward(self, input_ids, attention_mask=None):
        hidden = self.embed(input_ids)
        for block in self.layers:
            hidden = block(hidden, attention_mask)
        return self.head(hidden), self.pooled(hidden.mean(1))


def padded_batches(seed=0, pad_seed=1, batches=3, rows=4, length=10):
    """Dict batches whose padded positions (attention_mask 0) hold ids drawn from ``pad_seed``."""
    generator, pads = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(pad_seed)
    out = []
    for _ in range(batches):
        lengths = torch.randint(2, length + 1, (rows,), generator=generator)
        mask = (torch.arange(length) < lengths[:, None]).long()
        ids = torch.randint(VOCAB, (rows, length), generator=generator)
        ids = torch.where(mask.bool(), ids, torch.randint(VOCAB, (rows, length), generator=pads))
        out.append(dict(input_ids=ids, attention_mask=mask))
    return out


def model():
    torch.manual_seed(0)
    return Tiny()


def record(m, name):
    module = m.get_submodule(name)
    return new_record(kind_of(module), name, module)


def converted_weights(batches, **options):
    m = model()
    report = panther_lite.convert(
        m, target_modules=["up", "down", "head"], param_ratio=0.5, calibration_data=batches, progress=False, **options
    )
    weights = {name: mod.effective_weight() for name, mod in m.named_modules() if hasattr(mod, "effective_weight")}
    return report, weights


def test_the_gram_holds_only_real_tokens_and_counts_them():
    m, batches = model(), padded_batches()
    records = [record(m, "layers.0.up"), record(m, "pooled")]
    calibration = collect_grams(m, records, CalibrationData(batches), False)
    inputs = []
    handle = m.layers[0].up.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    with torch.no_grad():
        for batch in batches:
            m(**batch)
    handle.remove()
    real = torch.cat([x[b["attention_mask"].bool()] for x, b in zip(inputs, batches)]).double()
    up = calibration.recorders["layers.0.up"]
    torch.testing.assert_close(up.gram, real.t() @ real, rtol=1e-12, atol=1e-12)
    assert up.rows == sum(int(b["attention_mask"].sum()) for b in batches) == real.shape[0]
    assert not up.unaligned
    pooled = calibration.recorders["pooled"]  # (batch, width) inputs: all rows, and it says so
    assert pooled.rows == sum(b["input_ids"].shape[0] for b in batches) and pooled.unaligned


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(shrinkage=0),
        dict(allocation="global"),
        dict(sequential=True),
        dict(blocks=False, sequential=True),
        dict(refine=dict(max_steps=3, patience=2)),
    ],
    ids=["uniform", "no-shrinkage", "global", "sequential-blocks", "sequential-whole", "refine"],
)
def test_padded_positions_change_no_fit_and_no_count(options):
    report, weights = converted_weights(padded_batches(pad_seed=1), **options)
    other_report, other_weights = converted_weights(padded_batches(pad_seed=2), **options)
    assert set(weights) == set(other_weights) and weights
    for name, weight in weights.items():
        assert torch.equal(weight, other_weights[name]), name
    for column in ("low_rank", "calibration_rows", "shrinkage", "output_error"):
        assert report[column].equals(other_report[column]), column


def test_padding_would_change_the_fits_if_it_counted():
    """The check above can fail: without attention_mask the same batches give other fits."""
    unmasked = lambda pad_seed: [dict(input_ids=b["input_ids"]) for b in padded_batches(pad_seed=pad_seed)]
    _, weights = converted_weights(unmasked(1))
    _, other = converted_weights(unmasked(2))
    assert any(not torch.equal(weights[name], other[name]) for name in weights)


def test_the_report_counts_real_tokens_and_says_when_inputs_do_not_line_up():
    batches = padded_batches()
    real, sequences = sum(int(b["attention_mask"].sum()) for b in batches), sum(len(b["input_ids"]) for b in batches)
    m = model()
    report = panther_lite.convert(
        m, target_modules=["up", "down", "head", "pooled"], param_ratio=0.5, calibration_data=batches, progress=False,
        blocks=False,
    ).set_index("name")
    assert (report.loc[["layers.0.up", "layers.1.down", "head"], "calibration_rows"] == real).all()
    assert real < sum(b["input_ids"].numel() for b in batches)
    assert report.loc["pooled", "calibration_rows"] == sequences
    assert "do not line up with the batches' attention_mask" in report.loc["pooled", "reason"]
    assert report.loc["head", "reason"] == ""


def test_the_block_pipeline_counts_the_same_real_rows_as_the_whole_model():
    batches = padded_batches()
    by_blocks = converted_weights(batches)[0]
    whole = converted_weights(batches, blocks=False)[0]
    assert by_blocks.attrs["pipeline"].startswith("block pipeline")
    assert by_blocks["calibration_rows"].equals(whole["calibration_rows"])
    torch.testing.assert_close(
        torch.tensor(by_blocks["output_error"].to_numpy()), torch.tensor(whole["output_error"].to_numpy())
    )
