import pytest
import torch

from vllm_omni_kernels.modality import (
    OutputModality as M,
    TensorAccumulationStrategy as S,
    default_strategy,
    parse_strategy,
    resolve_strategy,
)
from vllm_omni_kernels.payload import GrowingTensor, MultimodalPayload


@pytest.mark.parametrize("text, expected", [
    ("text", M.TEXT), ("image", M.IMAGE), ("images", M.IMAGE), ("audio", M.AUDIO), ("speech", M.AUDIO),
    ("latent", M.LATENT), ("latents", M.LATENT), ("text+image", M.TEXT | M.IMAGE),
    ("image,text", M.TEXT | M.IMAGE), ("image+text", M.TEXT | M.IMAGE), (" Text + SPEECH ", M.TEXT | M.AUDIO),
    ("text+audio+image", M.TEXT | M.AUDIO | M.IMAGE), ("", M.TEXT), (None, M.TEXT), ("   ", M.TEXT),
])
def test_from_string_normalizes_aliases_and_combinations(text, expected):
    assert M.from_string(text) == expected


@pytest.mark.parametrize("text", ["video", "text+smell", "text++image", "pooling"])
def test_from_string_rejects_unknown_parts_naming_supported(text):
    with pytest.raises(ValueError, match="supported") as info:
        M.from_string(text)
    assert "audio" in str(info.value)


def test_from_string_takes_a_modality_or_its_value_and_refuses_other_types_with_a_value_error():
    assert M.from_string(M.TEXT | M.AUDIO) == M.TEXT | M.AUDIO
    assert M.from_string(M.AUDIO.value) == M.AUDIO
    with pytest.raises(ValueError):
        M.from_string(1.5)


def test_has_text_and_has_multimodal():
    assert M.TEXT.has_text and not M.TEXT.has_multimodal
    assert (M.TEXT | M.IMAGE).has_text and (M.TEXT | M.IMAGE).has_multimodal
    assert not M.AUDIO.has_text and M.AUDIO.has_multimodal


def test_default_strategy_audio_wins_then_rows():
    assert default_strategy(M.AUDIO) is S.CONCAT_LAST
    assert default_strategy(M.AUDIO | M.IMAGE) is S.CONCAT_LAST
    assert default_strategy(M.IMAGE) is S.CONCAT_DIM0
    assert default_strategy(M.LATENT) is S.CONCAT_DIM0
    assert default_strategy(M.TEXT) is S.CONCAT_DIM0


def test_resolve_strategy_metadata_declared_then_default():
    t = torch.zeros(4, 2)
    assert resolve_strategy("sr", 24000, M.AUDIO) is S.REPLACE
    assert resolve_strategy("sr", torch.tensor(24000), M.AUDIO) is S.REPLACE
    assert resolve_strategy("sr", torch.tensor(24000), M.AUDIO, {"sr": S.CONCAT_LAST}) is S.REPLACE
    assert resolve_strategy("codes", t, M.AUDIO, {"codes": S.CONCAT_DIM0}) is S.CONCAT_DIM0
    assert resolve_strategy("audio", t, M.AUDIO) is S.CONCAT_LAST
    assert resolve_strategy("image", t, M.IMAGE) is S.CONCAT_DIM0


def test_parse_strategy_accepts_names_and_values():
    assert parse_strategy("concat_last") is S.CONCAT_LAST
    assert parse_strategy("APPEND_LIST") is S.APPEND_LIST
    assert parse_strategy(S.REPLACE) is S.REPLACE
    with pytest.raises(ValueError, match="supported"):
        parse_strategy("stack")
    for value in (None, 3, ["concat_last"]):  # (a processor's strategies={"audio": None}, a typo in a config)
        with pytest.raises(ValueError, match="supported"):
            parse_strategy(value)


def test_payload_primary_tensor_and_access():
    p = MultimodalPayload()
    assert p.primary_tensor is None and not p
    a, b = torch.ones(3), torch.zeros(2)
    p = MultimodalPayload(tensors={"audio": a, "codes": b}, metadata={"sr": 24000})
    assert p.primary_tensor is a and p
    assert p.get("codes") is b and p.get("sr") == 24000 and p.get("missing", 7) == 7
    assert MultimodalPayload(tensors={"l": [a]}, metadata={}).primary_tensor is None


def test_payload_merge_chain_copies_each_piece_once_and_keeps_every_payload_unchanged():
    """AsyncLLM merges every DELTA output its consumer has not read into the first: a long chain
    must equal one concatenation (mono, multi-channel along the last axis, rows along the first),
    every payload of the chain must keep its own tensors, and merging one payload twice (two
    branches) must give two independent results."""
    gen = torch.Generator().manual_seed(0)
    audio = [torch.randn(7 + i, generator=gen) for i in range(40)]
    stereo = [torch.randn(2, 3 + i % 5, generator=gen) for i in range(40)]
    codes = [torch.randint(0, 9, (1 + i % 3, 8), generator=gen) for i in range(40)]
    axes = {"audio": -1, "stereo": -1, "codes": 0}
    chain = [MultimodalPayload({"audio": audio[0], "stereo": stereo[0], "codes": codes[0]}, axes=dict(axes))]
    for i in range(1, 40):
        later = MultimodalPayload({"audio": audio[i], "stereo": stereo[i], "codes": codes[i]}, {"step": i}, dict(axes))
        chain.append(chain[-1].merge(later))
    for i, merged in enumerate(chain):
        assert torch.equal(merged.tensors["audio"], torch.cat(audio[:i + 1]))
        assert torch.equal(merged.tensors["stereo"], torch.cat(stereo[:i + 1], dim=-1))
        assert torch.equal(merged.tensors["codes"], torch.cat(codes[:i + 1]))
    assert chain[-1].metadata["step"] == 39
    left = chain[5].merge(MultimodalPayload({"audio": audio[30]}, axes={"audio": -1}))
    right = chain[5].merge(MultimodalPayload({"audio": audio[31]}, axes={"audio": -1}))
    assert torch.equal(left.tensors["audio"], torch.cat(audio[:6] + [audio[30]]))
    assert torch.equal(right.tensors["audio"], torch.cat(audio[:6] + [audio[31]]))
    assert torch.equal(chain[6].tensors["audio"], torch.cat(audio[:7]))
    with pytest.raises(ValueError, match="cannot append"):  # a copy would broadcast it
        chain[-1].merge(MultimodalPayload({"codes": torch.zeros(2, 1, dtype=torch.int64)}, axes={"codes": 0}))


def test_payload_merge_is_torch_cat_for_pieces_of_other_dtypes_and_conjugate_views():
    """A later piece of a wider dtype promotes the data as ``torch.cat`` does (it is not cast down
    to the first piece's), and a lazily conjugated complex piece or negated float piece is copied as
    its values."""
    ints = MultimodalPayload({"x": torch.tensor([1, 2])}, axes={"x": 0})
    floats = MultimodalPayload({"x": torch.tensor([1.5])}, axes={"x": 0})
    merged = ints.merge(floats).merge(MultimodalPayload({"x": torch.tensor([3])}, axes={"x": 0}))
    assert merged.tensors["x"].dtype == torch.float32 and merged.tensors["x"].tolist() == [1.0, 2.0, 1.5, 3.0]
    z = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    first = MultimodalPayload({"z": z.conj()}, axes={"z": -1})
    got = first.merge(MultimodalPayload({"z": z.conj()}, axes={"z": -1})).tensors["z"]
    assert torch.equal(got, torch.cat([z.conj(), z.conj()]))
    # a lazily negated float16 piece after float32 data (torch's copy between the two drops the negation)
    for first, later in ((torch.tensor([5.0]), torch.tensor([1.0, 2.0], dtype=torch.float16)),
                         (torch.tensor([5.0], dtype=torch.float16), torch.tensor([1.0, 2.0]))):
        later = torch._neg_view(later)
        got = MultimodalPayload({"a": first}, axes={"a": 0}).merge(MultimodalPayload({"a": later}, axes={"a": 0}))
        assert got.tensors["a"].tolist() == torch.cat([first, later]).tolist() == [5.0, -1.0, -2.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
@pytest.mark.parametrize("capacity", [0, 5, 10_000])
def test_growing_tensor_equals_one_concatenation(dtype, capacity):
    """Every view of a ``GrowingTensor`` is the concatenation of the pieces so far, whatever the
    capacity it was sized for (too small: it grows, by more than twice for a piece longer than all
    before it; too large: it is not filled) and whether numpy copies the dtype or its bits
    (bfloat16); earlier views stay as they were."""
    gen = torch.Generator().manual_seed(1)
    for shape, axis in (((0,), 0), ((2, 0), -1), ((0, 3), 0), ((2, 0, 3), 1)):
        pieces = []
        for i in range(12):
            size = list(shape)
            size[axis] = 1 + (i * 7) % 5 if i < 11 else 200
            pieces.append((torch.randn(size, generator=gen) * 100).to(dtype))
        grow = GrowingTensor(pieces[0], axis, capacity)
        views = [grow.view()]
        for piece in pieces[1:]:
            grow.append(piece)
            views.append(grow.view())
        for i, view in enumerate(views):
            assert torch.equal(view, torch.cat(pieces[:i + 1], dim=axis)), (shape, axis, i)
        assert grow.ends_with(views[-1]) and not grow.ends_with(views[-2])
        wrong = list(pieces[0].shape)
        wrong[(axis + 1) % len(wrong) if len(wrong) > 1 else 0] += 1
        if len(wrong) > 1:
            with pytest.raises(ValueError, match="cannot append"):
                grow.append(torch.zeros(wrong, dtype=dtype))
