"""benchmarks/bench_svd_llm.py: its SVD-LLM (written from the paper) is the optimal rank-r fit of
the layer's outputs, which convert's unshrunk uniform fit must match."""
import torch
import torch.nn as nn

import panther_lite


def test_svd_llm_equals_the_unshrunk_whitened_fit_of_convert(load_script):
    bench = load_script("benchmarks/bench_svd_llm.py")
    torch.manual_seed(0)
    layer = nn.Linear(24, 16, dtype=torch.float64)
    x = torch.randn(64, 24, dtype=torch.float64) @ torch.randn(24, 24, dtype=torch.float64)
    expected = bench.svd_llm_weight(layer.weight, x.t() @ x, 6)
    model = nn.Sequential(layer)
    panther_lite.convert(model, num_terms=1, low_rank=3, calibration_data=[x], shrinkage=0, progress=False)
    ours = model[0].effective_weight().detach()
    error = lambda approx: float((x @ (layer.weight.detach() - approx).t()).norm())
    # the same optimum (convert damps the Gram by 1e-4 of its mean diagonal, SVD-LLM does not)
    assert abs(error(ours) / error(expected) - 1) < 1e-6
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)


def test_svd_llm_grams_hold_only_real_tokens(load_script):
    bench = load_script("benchmarks/bench_svd_llm.py")

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.proj = nn.Embedding(10, 4), nn.Linear(4, 4)

        def forward(self, input_ids, attention_mask):
            return self.proj(self.embed(input_ids))

    model = Tiny()
    ids, mask = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    grams = bench.real_token_grams(model, {"proj": model.proj}, [dict(input_ids=ids, attention_mask=mask)])
    rows = model.embed(ids)[mask.bool()].detach().double()
    torch.testing.assert_close(grams["proj"], rows.t() @ rows)
