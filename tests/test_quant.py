"""quant/: packing, RTN, rotations, every preset's round trip and its honest byte count.

Oracles are independent of the code under test: bit layouts rebuilt with python ints, the
Sylvester construction of the Hadamard matrix, QLoRA's published NF4 table, argmin over
levels, and analytic bounds (half an RTN step).
"""

import json
import math

import pytest
import torch

import quant
from quant import kvmix
from quant.hadamard import fwht, hadamard
from quant.kvarn import imbalance, sinkhorn
from quant.nqkv import NF4_LEVELS, block_size
from quant.rtn import dequantize, pack, pack_planes, packed_shape, plane_specs, quantize, unpack_planes

# a plan exercising every KVmix bit width, for tests that need a kvmix format
MIXED_PLAN = {"method": "kvmix", "layers": [
    {"k_bits": 2, "v_bits": 2, "window_ratio": 0.1},
    {"k_bits": 3, "v_bits": 4, "window_ratio": 0.2},
    {"k_bits": 4, "v_bits": 3, "window_ratio": 0.0},
]}


def layer_formats(name: str) -> list[quant.KVFormat]:
    """Every distinct per-layer format of a preset (one for uniform presets)."""
    if name == "kvmix":
        fmt = quant.get_format("kvmix", plan=MIXED_PLAN)
        return [fmt.for_layer(i) for i in range(len(MIXED_PLAN["layers"]))]
    return [quant.get_format(name)]


def rel_mse(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).pow(2).mean() / exact.pow(2).mean()).item()


def roundtrip(fmt: quant.KVFormat, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reconstructed K and V in the original domain."""
    return fmt.k.unrotate(fmt.k.decode(fmt.k.encode(k))), fmt.v.unrotate(fmt.v.decode(fmt.v.encode(v)))


# ---- packing ------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,tokens", [(1, 128), (1, 16), (2, 128), (2, 8), (4, 128), (4, 6), (3, 128), (3, 24)])
def test_pack_unpack_bijection(bits, tokens):
    g = torch.Generator().manual_seed(bits * 1000 + tokens)
    codes = torch.randint(0, 2**bits, (2, 3, tokens, 5), generator=g, dtype=torch.uint8)
    planes = pack_planes(codes, bits)
    specs = plane_specs(3, tokens, 5, bits)
    assert planes.keys() == specs.keys() == ({"codes", "high"} if bits == 3 else {"codes"})
    for name, plane in planes.items():
        assert (plane.shape[1:], plane.dtype) == specs[name]
    assert torch.equal(unpack_planes(planes, bits), codes)
    # and the other way: every packed plane is the image of exactly one code plane
    planes = {name: torch.randint(0, 256, shape, generator=g, dtype=dtype) for name, (shape, dtype) in specs.items()}
    assert all(torch.equal(planes[n], p) for n, p in pack_planes(unpack_planes(planes, bits), bits).items())
    # `bits` bits a code, exactly (3 heads x tokens x 5 channels)
    assert sum(math.prod(shape) for shape, _ in specs.values()) * 8 == 3 * tokens * 5 * bits


@pytest.mark.parametrize("bits,tokens", [(1, 16), (2, 16), (4, 16), (3, 32)])
def test_pack_split_layout(bits, tokens):
    """Rebuild every packed byte from python ints, following quant/rtn.py's layout description literally."""
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 2**bits, (tokens, 3), generator=g, dtype=torch.uint8)
    planes = pack_planes(codes, bits)
    # 3 bits: the two low bits as a 2-bit plane, the high bit as a 1-bit plane
    parts = {"codes": (2, codes & 3), "high": (1, codes >> 2)} if bits == 3 else {"codes": (bits, codes)}
    for name, (width, part) in parts.items():
        per_byte = 8 // width
        rows = tokens // per_byte
        assert planes[name].shape == (rows, 3)
        for i in range(rows):
            for d in range(3):
                # slot j of row i holds token j*rows + i at bits [width*j, width*(j+1))
                expect = sum(int(part[j * rows + i, d]) << (width * j) for j in range(per_byte))
                assert int(planes[name][i, d]) == expect


def test_pack_rejects_bad_shapes():
    with pytest.raises(ValueError):
        pack(torch.zeros(6, 2, dtype=torch.uint8), 2)  # 6 tokens do not fill 4-per-byte rows
    with pytest.raises(ValueError):
        pack_planes(torch.zeros(12, 2, dtype=torch.uint8), 3)  # the high bit's plane needs 8-token rows
    with pytest.raises(ValueError):
        packed_shape(128, 64, 5)
    with pytest.raises(ValueError, match="two planes"):
        packed_shape(128, 64, 3)


# ---- RTN ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim", [-2, -1])
def test_rtn_error_at_most_half_step(bits, dim):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 128, 64, generator=g) * torch.logspace(-2, 2, 64) + 5 * torch.randn(64, generator=g)
    x[:, :, 0] = 1.2345  # a constant channel (zero range)
    codes, scale, zero = quantize(x, bits, dim)
    assert scale.dtype == zero.dtype == torch.float16 and codes.dtype == torch.uint8
    assert int(codes.max()) <= 2**bits - 1
    err = (dequantize(codes, scale, zero, dim) - x).abs()
    bound = scale.float().unsqueeze(dim) / 2
    assert (err <= bound * (1 + 1e-5) + 1e-6).all()
    # the grid is used end to end: each group's max maps to the top code and its min to 0,
    # except where fp16 rounding of the zero costs half a step (ranges tiny against |min|)
    wide = x.amax(dim) > x.amin(dim)
    assert (codes.amax(dim)[wide] == 2**bits - 1).all()
    assert (codes.amin(dim)[wide] == 0).float().mean() > 0.95


def test_rtn_per_group_bits():
    """Kitty's mixed widths: a per-channel bits tensor gives each channel its own grid."""
    x = torch.randn(128, 8)
    bits = torch.tensor([4, 2, 2, 4, 2, 2, 2, 2]).unsqueeze(0)
    codes, scale, zero = quantize(x, bits, -2)
    assert codes.amax(-2).tolist() == [15, 3, 3, 15, 3, 3, 3, 3]
    steps = (x.amax(-2) - x.amin(-2)) / (2 ** bits[0] - 1)
    assert torch.allclose(scale.float(), steps, rtol=2e-3)


# ---- KVarN: rotation and Sinkhorn ---------------------------------------------------------

def sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(d)


@pytest.mark.parametrize("d", [64, 128])
def test_hadamard_orthonormal_and_preserves_dot_products(d):
    hd = hadamard(d)
    assert torch.allclose(hd, sylvester(d), atol=1e-6)
    assert torch.allclose(hd @ hd.T, torch.eye(d), atol=1e-5)
    q, k, v = torch.randn(3, 4, 17, d).unbind(0)
    fmt = quant.get_format("kvarn")
    assert fmt.rotated
    qr, kr, vr = fmt.rotate(q), fwht(k), fwht(v)
    assert torch.allclose(qr @ kr.transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-4)
    # attention over rotated K/V, un-rotated, equals attention over the originals
    p = torch.softmax(q @ k.transpose(-1, -2), -1)
    assert torch.allclose(fmt.unrotate(p @ vr), p @ v, atol=1e-5)
    with pytest.raises(ValueError):
        fwht(torch.randn(4, 96))


def test_sinkhorn_reduces_imbalance():
    g = torch.Generator().manual_seed(0)
    rows = torch.exp(2 * torch.randn(2, 128, 1, generator=g))
    cols = torch.exp(2 * torch.randn(2, 1, 64, generator=g))
    y = torch.randn(2, 128, 64, generator=g) * rows * cols
    before = imbalance(y)
    r, c = sinkhorn(y)
    after = imbalance(y / (r.unsqueeze(-1) * c.unsqueeze(-2)))
    assert (after < 0.2 * before).all()
    # the best round is kept: more rounds never make it worse
    r1, c1 = sinkhorn(y, iters=1)
    assert (after <= imbalance(y / (r1.unsqueeze(-1) * c1.unsqueeze(-2))) + 1e-6).all()


def test_kvarn_dual_scaling_helps():
    """Stored token scales (K) and channel scales (V) must pay off against no balancing (iters=0)."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 128, 64, generator=g) * torch.exp(1.5 * torch.randn(2, 128, 1, generator=g))  # loud tokens
    # values whose rotated domain has loud channels (Hd is its own inverse)
    v = fwht(torch.randn(2, 128, 64, generator=g) * torch.exp(1.5 * torch.randn(2, 1, 64, generator=g)))
    balanced, plain = quant.get_format("kvarn"), quant.get_format("kvarn", iters=0)
    for codec, x in (("k", k), ("v", v)):
        errs = [rel_mse(getattr(f, codec).unrotate(getattr(f, codec).decode(getattr(f, codec).encode(x))), x) for f in (balanced, plain)]
        assert errs[0] < 0.5 * errs[1], (codec, errs)


def test_kvarn_decodes_into_rotated_domain():
    x = torch.randn(1, 2, 128, 64)
    codec = quant.get_format("kvarn-k4v2").k
    y = codec.decode(codec.encode(x))
    assert rel_mse(y, fwht(x)) < 0.02 < rel_mse(y, x)


# ---- Kitty --------------------------------------------------------------------------------

@pytest.mark.parametrize("preset,nb", [("kitty", 8), ("kitty-pro", 16)])
def test_kitty_boosts_exactly_the_top_channels(preset, nb):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 3, 128, 64, generator=g) * torch.rand(2, 3, 1, 64, generator=g) * 4
    codec = quant.get_format(preset).k
    fields = codec.encode(k)
    expected = k.abs().mean(-2).argsort(-1, descending=True)[..., :nb]
    assert fields["ids"].dtype == torch.int16 and torch.equal(fields["ids"].long(), expected)
    # boosted channels sit within half a 4-bit step, the rest within half a 2-bit step
    err = (codec.decode(fields) - k).abs().amax(-2)
    rng = k.amax(-2) - k.amin(-2)
    boosted = torch.zeros_like(rng, dtype=torch.bool).scatter(-1, expected, True)
    bound = torch.where(boosted, rng / 15, rng / 3) / 2
    assert (err <= bound * 1.01 + 1e-4).all()
    assert (err[~boosted] > torch.where(boosted, rng / 15, rng / 3)[~boosted] / 2 / 5).any()  # really 2-bit


def test_kitty_channel_scores():
    """Each score boosts the channel it is about: range, the widest (not the largest magnitude);
    q-aware, the one whose range times |q| is largest; magnitude, the largest mean |K|."""
    k = torch.randn(1, 1, 128, 64) * 0.1 + torch.linspace(0, 50, 64)  # big means, small spread
    k[..., 5] += torch.linspace(-4, 4, 128)  # the widest channel, small mean
    top = {score: int(quant.get_format("kitty", score=score).k.encode(k, **extra)["ids"][0, 0, 0])
           for score, extra in [("magnitude", {}), ("range", {}),
                                ("q-aware", {"query_weight": torch.ones(1, 1, 64).index_fill_(-1, torch.tensor([9]), 1e3)})]}
    assert top == {"magnitude": 63, "range": 5, "q-aware": 9}
    no_queries = quant.get_format("kitty", score="q-aware").k.encode(k)  # ranks like range
    assert torch.equal(no_queries["ids"], quant.get_format("kitty", score="range").k.encode(k)["ids"])
    with pytest.raises(ValueError):
        quant.get_format("kitty", score="bogus")


# ---- NQKV ---------------------------------------------------------------------------------

# QLoRA's published NF4 table (bitsandbytes), the oracle for our computed quantiles
QLORA_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]


def test_nf4_levels_are_qloras():
    assert torch.allclose(NF4_LEVELS, torch.tensor(QLORA_NF4), atol=1e-6)


@pytest.mark.parametrize("heads,head_dim,block", [(8, 128, 256), (3, 64, 256), (1, 64, 256), (3, 128, 256), (4, 64, 32)])
def test_nf4_is_nearest_level_times_absmax(heads, head_dim, block):
    g = torch.Generator().manual_seed(heads)
    x = torch.randn(2, heads, 128, head_dim, generator=g) * torch.rand(1, heads, 128, 1, generator=g)
    codec = quant.get_format("nqkv", block=block).k
    b = block_size(heads, head_dim, block)
    assert heads * head_dim % b == 0 and (b % head_dim == 0 or head_dim % b == 0)
    # oracle: flatten each token over (head, channel), absmax per block, argmin over levels
    flat = x.transpose(1, 2).reshape(2, 128, -1, b)
    scale = flat.abs().amax(-1, keepdim=True).half().float()
    levels = NF4_LEVELS  # checked against QLoRA's table above; exact ties would flip on 1e-7 differences
    nearest = levels[(flat / scale).unsqueeze(-1).sub(levels).abs().argmin(-1)]
    expect = (nearest * scale).reshape(2, 128, heads, head_dim).transpose(1, 2)
    assert torch.allclose(codec.decode(codec.encode(x)), expect, atol=1e-6)


def test_nqkv_block_rule():
    assert block_size(8, 128, 256) == 256
    assert block_size(3, 64, 256) == 192  # H*D < B: the whole token, 3 whole heads
    assert block_size(3, 128, 256) == 128  # 256 does not divide 384: one head per block
    assert block_size(2, 64, 32) == 32


# ---- all presets --------------------------------------------------------------------------

def outlier_kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian K with a few large-magnitude key channels (as post-RoPE keys have), Gaussian V."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 4, 128, 128, generator=g)
    k[..., [3, 40, 77, 100]] = k[..., [3, 40, 77, 100]] * 10 + 5
    return k, torch.randn(2, 4, 128, 128, generator=g)


def test_reconstruction_error_ordering():
    k, v = outlier_kv()
    err = {}
    for name in ("kivi-k4v4", "kitty-pro", "kitty", "kivi-k2v2", "kvarn"):
        k_hat, v_hat = roundtrip(quant.get_format(name), k, v)
        err[name] = rel_mse(k_hat, k) + rel_mse(v_hat, v)
    assert err["kivi-k4v4"] < err["kitty-pro"] < err["kitty"] < err["kivi-k2v2"], err
    assert err["kvarn"] < err["kivi-k2v2"], err


@pytest.mark.parametrize("name", quant.FORMAT_NAMES)
@pytest.mark.parametrize("heads,head_dim", [(1, 64), (3, 64), (1, 128), (3, 128)])
def test_roundtrip_shapes_dtypes_and_error(name, heads, head_dim):
    k, v = (torch.randn(2, heads, 128, head_dim, dtype=torch.float16) for _ in range(2))
    for fmt in layer_formats(name):
        for codec, x in ((fmt.k, k), (fmt.v, v)):
            fields = codec.encode(x)
            specs = codec.field_specs(heads, head_dim)
            assert set(fields) == set(specs)
            for field, (shape, dtype) in specs.items():
                assert fields[field].shape == (2, *shape) and fields[field].dtype == dtype, (fmt.name, field)
            y = codec.decode(fields)
            assert y.shape == x.shape and y.dtype == torch.float32
            # loose bounds per width, tight enough to catch a scrambled layout (error ~1 or more)
            bits = codec.kernel_layout(heads, head_dim).bits  # the width of the (low) code plane
            bound = {16: 1e-6, 4: 0.02, 3: 0.08, 2: 0.35}[bits]
            assert rel_mse(codec.unrotate(y), x.float()) < bound, (fmt.name, codec)


@pytest.mark.parametrize("name", quant.FORMAT_NAMES)
def test_kernel_layout_addresses_the_stored_fields(name):
    """A codec's kernel layout names exactly the fields it stores, its code planes with the rows
    they have (3-bit codes: a plane of T/4 rows and their high bit's of T/8), [H, rows, D] or, for
    quantized values, channel-major [H, D, rows]; the planes of 2-, 3- and 4-bit RTN keys keep
    their channels swapped in fours (stored column j holds channel 0 2 1 3 of its four), which
    decode undoes."""
    for heads, head_dim in ((1, 64), (3, 128)):
        for fmt in layer_formats(name):
            for codec in (fmt.k, fmt.v):
                lay, specs = codec.kernel_layout(heads, head_dim), codec.field_specs(heads, head_dim)
                assert {f for f in lay.fields if f is not None} == set(specs), (fmt.name, codec)
                assert lay.channel_major == (codec is fmt.v and lay.bits != 16), (fmt.name, codec)
                planes = [lay.fields[0]] + (["high"] if lay.bits == 3 else [])
                assert list(lay.code_planes) == planes
                for field, rows in zip(planes, (lay.rows, quant.PAGE_TOKENS // 8)):
                    want = (heads, head_dim, rows) if lay.channel_major else (heads, rows, head_dim)
                    assert specs[field][0] == want, (fmt.name, codec, field)
                swappable = codec is fmt.k and lay.bits in (2, 3, 4) and not lay.nf4
                assert lay.columns_swapped == swappable, (fmt.name, codec)
                if swappable:  # what is stored at column j is what the plain codec stores at order[j]
                    x = torch.randn(heads, 128, head_dim)
                    order = [(j & ~3) | (j & 1) << 1 | (j >> 1) & 1 for j in range(head_dim)]
                    for field in planes:
                        assert torch.equal(codec.encode(x)[field], codec.inner.encode(x)[field][..., order])
                    assert torch.equal(codec.decode(codec.encode(x)), codec.inner.decode(codec.inner.encode(x)))


@pytest.mark.parametrize("name", quant.FORMAT_NAMES)
def test_bits_per_element_counts_every_stored_byte(name):
    for heads, head_dim in ((1, 64), (3, 64), (8, 128)):
        x = torch.randn(heads, 128, head_dim)
        for fmt in layer_formats(name):
            stored = sum(t.numel() * t.element_size() for c in (fmt.k, fmt.v) for t in c.encode(x).values())
            elements = 2 * heads * 128 * head_dim
            assert fmt.page_bytes(heads, head_dim) == stored
            assert fmt.bits_per_element(heads, head_dim) * elements / 8 == pytest.approx(stored, abs=1e-9)


def test_other_page_lengths():
    x = torch.randn(2, 64, 64, dtype=torch.bfloat16)  # any float dtype in, float32 out
    for name in ("kivi-k2v2", "kitty", "kvarn", "nqkv", "kivi-k2v2:k_bits=3:v_bits=3"):
        fmt = quant.get_format(name)
        for codec in (fmt.k, fmt.v):
            fields = codec.encode(x)
            assert {f: t.shape for f, t in fields.items()} == {f: s for f, (s, _) in codec.field_specs(2, 64, 64).items()}
            assert rel_mse(codec.unrotate(codec.decode(fields)), x) < 0.35
        stored = sum(t.numel() * t.element_size() for c in (fmt.k, fmt.v) for t in c.encode(x).values())
        assert fmt.bits_per_element(2, 64, tokens=64) * (2 * 2 * 64 * 64) / 8 == stored


def test_bits_per_element_values():
    assert quant.get_format("fp16").bits_per_element(8, 128) == 16
    assert quant.get_format("kivi-k2v2").bits_per_element(8, 128) == 2.25  # 2 + 2x16 bits per 128
    assert quant.get_format("kitty").bits_per_element(8, 128) == pytest.approx(2.3828125)
    assert quant.get_format("kvarn").bits_per_element(8, 128) == 2.375


# ---- registry and KVmix -------------------------------------------------------------------

def test_registry():
    assert {"fp16", "kivi-k2v2", "kivi-k4v4", "kitty", "kitty-pro", "kvarn", "kvarn-k4v2", "nqkv", "kvmix"} <= set(quant.FORMAT_NAMES)
    with pytest.raises(ValueError, match="kivi-k2v2"):
        quant.get_format("kivi-k3v3")
    assert quant.get_format("kitty", ratio=0.5).k.n_boost(64) == 32  # options override presets
    assert quant.get_format("kivi-k2v2", v_group=32).v.field_specs(2, 64)["scale"][0] == (2, 128, 2)
    fmt = quant.get_format("kivi-k4v4")
    assert fmt.for_layer(5) is fmt and not fmt.rotated and fmt.name == "kivi-k4v4"


def test_kvmix_plan_roundtrip(tmp_path):
    plan = kvmix.plan_from_importance([1, 9, 3, 4, 5, 0, 2, 8, 7, 6], [9, 1, 3, 4, 5, 0, 2, 8, 7, 6], model="m")
    # top 20% of 10 layers = 2 layers each: K by k importance (K4, the rest K3), V by v importance (V4, the rest V2)
    assert [p.k_bits for p in plan.layers] == [3, 4, 3, 3, 3, 3, 3, 4, 3, 3]
    assert [p.v_bits for p in plan.layers] == [4, 2, 2, 2, 2, 2, 2, 4, 2, 2]
    assert [p.window_ratio for p in plan.layers].count(0.2) == 2
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["method"] == "kvmix" and len(data["layers"]) == 10 and data["layers"][1]["k_bits"] == 4
    fmt = quant.get_format("kvmix", plan=str(path))
    layers = fmt.layer_formats(10)
    assert layers[7].k.bits == 4 and layers[7].v.bits == 4 and layers[2].k.bits == 3 and layers[2].v.bits == 2
    # the cache keeps 20% of the context in fp16 for the 2 layers of top combined importance, 10% elsewhere
    assert sorted(fmt.window_ratios(10)) == [0.1] * 8 + [0.2] * 2
    assert kvmix.KVmixPlan.load(path) == plan
    per_layer = [fmt.for_layer(i).bits_per_element(3, 64) for i in range(10)]
    assert fmt.bits_per_element(3, 64) == pytest.approx(sum(per_layer) / 10)
    with pytest.raises(AttributeError, match="for_layer"):
        fmt.k
    with pytest.raises(ValueError, match="scripts/kvmix_plan.py"):
        fmt.layer_formats(30)
    with pytest.raises(ValueError):
        quant.get_format("kvmix", plan={"method": "kvmix", "layers": [{"k_bits": 5, "v_bits": 2, "window_ratio": 0.1}]})


def test_kvmix_default_plan():
    """The shipped plan (it is in the repository, so its absence is a failure): SmolLM2-135M's 30
    layers, keys at 4 bits everywhere (its 3-bit keys alone cost +3% perplexity), the top 20% of
    values at V4."""
    fmt = quant.get_format("kvmix")
    plan = fmt.plan
    assert len(fmt.layer_formats(30)) == 30
    assert {p.k_bits for p in plan.layers} == {4} and sum(p.v_bits for p in plan.layers) == 2 * 30 + 12


def test_kvmix_missing_plan_names_the_profiler(monkeypatch, tmp_path):
    monkeypatch.setattr(kvmix, "DEFAULT_PLAN", tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="python scripts/kvmix_plan.py"):
        quant.get_format("kvmix")


class TinyLM(torch.nn.Module):
    """Just enough of a model for the profiler: layers[i].attn.qkv_proj (q | k | v rows, counts in
    .parts) and forward(ids) -> logits."""

    def __init__(self, layers: int = 4, dim: int = 8, vocab: int = 16):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab)
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.Module()
            block.attn = torch.nn.Module()
            block.attn.qkv_proj = torch.nn.Linear(dim, 3 * dim)
            block.attn.qkv_proj.parts = {"q_proj": dim, "k_proj": dim, "v_proj": dim}
            self.layers.append(block)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.layers:
            q, k, v = block.attn.qkv_proj(x).chunk(3, dim=-1)
            x = x + torch.tanh(k) * v + 0.1 * q
        return self.head(x)


def test_kvmix_layer_importance_is_mean_gradient_norm():
    torch.manual_seed(0)
    model = TinyLM()
    prompts = [torch.randint(0, 16, (12,)) for _ in range(3)]
    k_imp, v_imp = kvmix.layer_importance(model, prompts, progress=False)
    # oracle: plain backward, .grad of the K and V rows of each projection, averaged by hand
    expect_k, expect_v = torch.zeros(4), torch.zeros(4)
    for ids in prompts:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(ids[None])[0, :-1], ids[1:]).backward()
        expect_k += torch.stack([b.attn.qkv_proj.weight.grad[8:16].norm() for b in model.layers])
        expect_v += torch.stack([b.attn.qkv_proj.weight.grad[16:].norm() for b in model.layers])
    assert torch.allclose(torch.tensor(k_imp), expect_k / 3, rtol=1e-5)
    assert torch.allclose(torch.tensor(v_imp), expect_v / 3, rtol=1e-5)
    assert all(p.requires_grad for p in model.parameters())  # restored after profiling


def test_report_measure_orders_formats():
    from scripts.format_report import measure

    g = torch.Generator().manual_seed(0)
    captured = []
    for _ in range(2):  # two layers of q [6 heads], k and v [3 kv heads], 2 pages of 128 tokens
        k = torch.randn(3, 256, 64, generator=g)
        k[..., :2] *= 10  # outlier channels
        captured.append((torch.randn(6, 256, 64, generator=g), k, torch.randn(3, 256, 64, generator=g)))
    fp16, k4, k2 = (measure(quant.get_format(n), captured) for n in ("fp16", "kivi-k4v4", "kivi-k2v2"))
    assert fp16["cosine"] > 0.9999 and fp16["k_mse"] < 1e-6 and fp16["bits"] == 16
    assert k2["cosine"] < k4["cosine"] < fp16["cosine"] and k4["out_err"] < k2["out_err"]
    assert k4["k_mse"] < k2["k_mse"] and k4["v_mse"] < k2["v_mse"]
