"""Training recipes with sketched layers: autocast (bf16, fp16 + GradScaler), activation
checkpointing, ``torch.compile`` in its three modes, and channels_last convolutions.

References are the same models in plain PyTorch: ``F.linear``/``F.conv2d`` with the
layers' effective weights, or the same sketched model run eagerly in float64.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from panther_lite.nn import SKConv2d, SKLinear

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)]
# half-precision tolerances for one GEMM chain against an fp32 reference
HALF_TOL = {torch.bfloat16: dict(rtol=4e-2, atol=4e-2), torch.float16: dict(rtol=5e-3, atol=5e-3)}
FLOAT64_TOL = dict(rtol=1e-12, atol=1e-12)


class Net(nn.Module):
    """SKConv2d → ReLU → SKLinear → GELU → SKLinear on ``(N, 3, 8, 8)`` inputs, 5 classes."""

    def __init__(self, dtype=torch.float32, device="cpu"):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.conv = SKConv2d(3, 8, kernel_size=3, padding=1, stride=2, num_terms=1, low_rank=2, seed=0, **kw)
        self.fc1 = SKLinear(8 * 4 * 4, 32, num_terms=2, low_rank=4, seed=1, **kw)
        self.fc2 = SKLinear(32, 5, num_terms=1, low_rank=2, seed=2, **kw)

    def features(self, x):
        return F.relu(self.conv(x)).flatten(1)

    def head(self, h):
        return self.fc2(F.gelu(self.fc1(h)))

    def forward(self, x):
        return self.head(self.features(x))


def dense_reference(net: Net, x):
    """The same function with plain ``F.conv2d``/``F.linear`` on the effective weights."""
    c = net.conv
    h = F.relu(F.conv2d(x, c.effective_weight(), c.bias, c.stride, c.padding, c.dilation)).flatten(1)
    h = F.gelu(F.linear(h, net.fc1.effective_weight(), net.fc1.bias))
    return F.linear(h, net.fc2.effective_weight(), net.fc2.bias)


def data(n=16, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=gen, dtype=dtype)
    y = torch.randint(0, 5, (n,), generator=gen)
    return x.to(device), y.to(device)


def grads(model: nn.Module) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def train_losses(model, x, y, steps, step_fn):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(step_fn(model, opt, x, y))
    return losses


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_matches_fp32_and_keeps_fp32_gradients(device, dtype):
    torch.manual_seed(0)
    net = Net(device=device)
    x, y = data(device=device)
    with torch.autocast(device_type=device, dtype=dtype):
        out = net(x)
        assert out.dtype == dtype
        F.cross_entropy(out.float(), y).backward()
    torch.testing.assert_close(out.float(), dense_reference(net, x).detach(), **HALF_TOL[dtype])
    for name, p in net.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
    for buffer in net.buffers():
        assert buffer.dtype == torch.float32  # autocast casts copies, never the fixed sketches


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_training_reduces_loss(device):
    torch.manual_seed(0)
    net = Net(device=device)
    x, y = data(device=device)

    def step(model, opt, x, y):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    losses = train_losses(net, x, y, 20, step)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_grad_scaler_unscales_to_the_fp32_gradients(device):
    torch.manual_seed(0)
    net = Net(device=device)
    x, y = data(device=device)
    F.cross_entropy(net(x), y).backward()
    fp32 = grads(net)
    net.zero_grad()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(net(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    for name, g in grads(net).items():
        scale = fp32[name].abs().max().item()
        torch.testing.assert_close(g, fp32[name], rtol=1e-2, atol=1e-2 * scale, msg=lambda m: f"{name}: {m}")
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(p, before[n]) for n, p in net.named_parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_grad_scaler_skips_overflowing_steps(device):
    torch.manual_seed(0)
    net = Net(device=device)
    x, y = data(device=device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**60)  # the scaled fp16 backward overflows
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(net(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    for name, p in net.named_parameters():
        assert torch.equal(p, before[name]), name
    assert scaler.get_scale() < 2.0**60


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    net = Net(dtype=torch.float64)
    x, y = data(dtype=torch.float64)
    x.requires_grad_(True)
    F.cross_entropy(net(x), y).backward()
    expected, expected_x = grads(net), x.grad.clone()
    net.zero_grad()
    x.grad = None
    h = checkpoint(net.features, x, use_reentrant=False)
    F.cross_entropy(checkpoint(net.head, h, use_reentrant=False), y).backward()
    for name, g in grads(net).items():
        torch.testing.assert_close(g, expected[name], **FLOAT64_TOL, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(x.grad, expected_x, **FLOAT64_TOL)


# max-autotune with every CPU GEMM backend: whether inductor's C++ GEMM template is a
# candidate depends on the CPU, so "ATEN,CPP" makes it one on every machine.
COMPILE_MODES = [
    pytest.param("default", "ATEN,TRITON,CPP", id="default"),
    pytest.param("reduce-overhead", "ATEN,TRITON,CPP", id="reduce-overhead"),
    pytest.param("max-autotune", "ATEN,TRITON,CPP", id="max-autotune"),
    pytest.param("max-autotune", "ATEN,CPP", id="max-autotune-cpp-template"),
]


@pytest.mark.parametrize(("mode", "gemm_backends"), COMPILE_MODES)
def test_compile_fullgraph_matches_eager(mode, gemm_backends):
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net()
    x, y = data()
    F.cross_entropy(net(x), y).backward()
    eager_out, eager_grads = net(x).detach(), grads(net)
    net.zero_grad()
    compiled = torch.compile(net, mode=None if mode == "default" else mode, fullgraph=True)
    with torch._inductor.config.patch(max_autotune_gemm_backends=gemm_backends, fx_graph_cache=False):
        out = compiled(x)
        F.cross_entropy(out, y).backward()
    torch.testing.assert_close(out.detach(), eager_out, rtol=1e-5, atol=1e-6)
    for name, g in grads(net).items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.cuda
def test_compile_reduce_overhead_replays_cuda_graphs():
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net(device="cuda").eval()
    compiled = torch.compile(net, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for seed in range(3):  # the third call replays the recorded graph
            x, _ = data(device="cuda", seed=seed)
            out = compiled(x).clone()
            torch.testing.assert_close(out, net(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_skconv2d_matches_contiguous(device):
    torch.manual_seed(0)
    net = Net(dtype=torch.float64, device=device)
    x, y = data(dtype=torch.float64, device=device)
    F.cross_entropy(net(x), y).backward()
    expected, expected_grads = net(x).detach(), grads(net)
    net.zero_grad()
    net = net.to(memory_format=torch.channels_last)
    assert net.conv.S.is_contiguous(memory_format=torch.channels_last)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    conv_out = net.conv(x_cl)
    dense = nn.Conv2d(3, 8, kernel_size=3, padding=1, stride=2, dtype=torch.float64, device=device)
    dense_out = dense.to(memory_format=torch.channels_last)(x_cl)  # CUDA float64 (no cuDNN) gives NCHW
    assert conv_out.is_contiguous(memory_format=torch.channels_last) == dense_out.is_contiguous(
        memory_format=torch.channels_last
    )
    torch.testing.assert_close(conv_out, net.conv(x), **FLOAT64_TOL)
    out = net(x_cl)
    F.cross_entropy(out, y).backward()
    torch.testing.assert_close(out, expected, **FLOAT64_TOL)
    for name, g in grads(net).items():
        torch.testing.assert_close(g, expected_grads[name], **FLOAT64_TOL, msg=lambda m: f"{name}: {m}")
