"""The multimodal field through vLLM's own msgpack encoder and decoder (marker vllm)."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from vllm_omni_kernels.errors import TensorAccumulationError  # noqa: E402
from vllm_omni_kernels.payload import MultimodalPayload  # noqa: E402
from vllm_omni_kernels.vllm_integration.wire import (  # noqa: E402
    MultimodalRegion, OmniEngineCoreOutput, OmniEngineCoreOutputs, OmniMsgpackDecoder, decode_completion,
    decode_payload, encode_completion, encode_payload, tensor_paths)
from vllm_omni_kernels.vllm_integration.outputs import MultimodalCompletionOutput  # noqa: E402

pytestmark = pytest.mark.vllm


def frame():
    audio = torch.randn(48000)
    codes = torch.randint(0, 4096, (25, 16), dtype=torch.int64)
    sr = torch.tensor(24000)
    outs = EngineCoreOutputs(outputs=[
        OmniEngineCoreOutput(request_id="tts", new_token_ids=[7, 8],
                             multimodal_output={"audio": audio, "codes": codes, "sr": sr}),
        EngineCoreOutput(request_id="text", new_token_ids=[9], finish_reason=FinishReason.STOP),
        OmniEngineCoreOutput(request_id="quiet", new_token_ids=[1])])
    return outs, audio, codes, sr


def test_multimodal_output_survives_vllm_encoder_and_omni_decoder_exactly():
    outs, audio, codes, sr = frame()
    bufs = MsgpackEncoder().encode(outs)
    assert len(bufs) >= 3  # large tensors travel as zero-copy side buffers
    got = OmniMsgpackDecoder().decode(bufs)
    tts, text, quiet = got.outputs
    mm = tts.multimodal_output
    assert isinstance(tts, OmniEngineCoreOutput) and tts.new_token_ids == [7, 8]
    assert mm["audio"].dtype == torch.float32 and torch.equal(mm["audio"], audio)
    assert mm["codes"].dtype == torch.int64 and torch.equal(mm["codes"], codes)
    assert mm["sr"].dim() == 0 and int(mm["sr"]) == 24000
    assert text.multimodal_output is None and text.finish_reason == FinishReason.STOP  # a frame without it
    assert quiet.multimodal_output is None



def test_tensors_nested_in_plain_values_arrive_as_tensors():
    """vLLM's decoder restores tensors only where a field is typed as one: a plain value holding
    tensors in a dict or a list (one past vLLM's inline size: a buffer of its own) arrives as it
    was sent, as it does in process; a bad one of them fails that key of that request."""
    t = torch.arange(4096, dtype=torch.float32)
    sent = {"audio": t, "extra": {"pitch": t, "small": t[:8], "notes": ["a", 1]}, "parts": [t[:2], [t]]}
    outs = EngineCoreOutputs(outputs=[OmniEngineCoreOutput(request_id="a", new_token_ids=[1],
                                                           multimodal_output=sent)])
    got = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs)).outputs[0].multimodal_output
    assert torch.equal(got["audio"], t) and torch.equal(got["extra"]["pitch"], t)
    assert torch.equal(got["extra"]["small"], t[:8]) and got["extra"]["notes"] == ["a", 1]
    assert torch.equal(got["parts"][0], t[:2]) and torch.equal(got["parts"][1][0], t)
    frames = MsgpackEncoder().encode(outs)
    bad = OmniMsgpackDecoder().decode([frames[0]]).outputs[0].multimodal_output  # their buffers left out
    assert isinstance(bad["extra"], TensorAccumulationError) and bad["extra"].key == "extra"
    assert isinstance(bad["parts"], TensorAccumulationError) and bad["extra"].request_id == "a"

def test_vllm_own_decoder_drops_the_field_silently():
    """Why the decoder piece exists: vLLM's client decoder keeps only EngineCoreOutput's fields."""
    outs, *_ = frame()
    plain = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outs))
    assert type(plain.outputs[0]) is EngineCoreOutput
    assert not hasattr(plain.outputs[0], "multimodal_output")


def test_plain_vllm_frames_decode_with_the_omni_decoder():
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="a", new_token_ids=[1, 2])])
    got = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs))
    assert got.outputs[0].new_token_ids == [1, 2] and got.outputs[0].multimodal_output is None


def test_empty_fields_are_none_and_cost_one_nil_each():
    """Empty multimodal fields are stored as None; vLLM's array-like frames keep every position (its
    own None fields are encoded too), so each of the six fields costs one msgpack byte (a nil, or the
    count of held tokens, 0)."""
    empty = OmniEngineCoreOutput.from_base(EngineCoreOutput(request_id="a", new_token_ids=[1]), {})
    assert empty.multimodal_output is None and empty.multimodal_error is None and empty.multimodal_delivered is None
    with_none = bytes(MsgpackEncoder().encode(empty)[0])
    base = bytes(MsgpackEncoder().encode(EngineCoreOutput(request_id="a", new_token_ids=[1]))[0])
    assert len(with_none) == len(base) + 6 and with_none.endswith(b"\xc0" * 5 + b"\x00")


@pytest.mark.parametrize("lookalike", [["float32", [2], 0], ["int64", [], b"12345678"], ("uint8", [1], 1)])
def test_a_plain_value_shaped_like_an_encoded_tensor_arrives_as_it_was_sent(lookalike):
    """vLLM's encoder makes a tensor a [dtype, shape, data] list; a plain list of that form is not
    one, and stays a list, beside a real tensor of the same output and at any depth."""
    audio = torch.arange(8, dtype=torch.float32)
    sent = {"audio": audio, "meta": lookalike, "deep": {"x": [lookalike, audio]}}
    outs = EngineCoreOutputs(outputs=[OmniEngineCoreOutput(request_id="a", new_token_ids=[1],
                                                           multimodal_output=sent)])
    got = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs)).outputs[0].multimodal_output
    want = list(lookalike)  # msgpack has one array type: a tuple arrives as a list
    assert got["meta"] == want and got["deep"]["x"][0] == want
    assert torch.equal(got["audio"], audio) and torch.equal(got["deep"]["x"][1], audio)


def test_a_path_that_leads_to_no_tensor_fails_its_key_only():
    audio = torch.arange(8, dtype=torch.float32)
    outs = EngineCoreOutputs(outputs=[
        OmniEngineCoreOutput(request_id="a", new_token_ids=[1], multimodal_output={"audio": audio, "n": 3},
                             multimodal_tensors=[["audio"], ["n"], ["missing", 0]]),
        OmniEngineCoreOutput(request_id="b", new_token_ids=[2], multimodal_output={"audio": audio})])
    a, b = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs)).outputs
    assert torch.equal(a.multimodal_output["audio"], audio) and torch.equal(b.multimodal_output["audio"], audio)
    for key in ("n", "missing"):
        err = a.multimodal_output[key]
        assert isinstance(err, TensorAccumulationError) and err.request_id == "a" and err.key == key


@pytest.mark.parametrize("paths", [[[0]], [[]]])
def test_a_tensor_place_that_names_no_key_fails_that_request_only(paths):
    """A damaged frame whose tensor places name no key: that request gets an error instead of its
    values; the message's other request is as it was sent."""
    audio = torch.arange(8, dtype=torch.float32)
    outs = EngineCoreOutputs(outputs=[
        OmniEngineCoreOutput(request_id="a", new_token_ids=[1], multimodal_output={"audio": audio},
                             multimodal_tensors=paths),
        OmniEngineCoreOutput(request_id="b", new_token_ids=[2], multimodal_output={"audio": audio}),
        OmniEngineCoreOutput(request_id="c", new_token_ids=[3], multimodal_tensors=[["audio"]])])
    a, b, c = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs)).outputs
    assert a.multimodal_output is None and a.multimodal_error is not None
    assert torch.equal(b.multimodal_output["audio"], audio)
    assert c.multimodal_output is None and c.multimodal_error is None and c.new_token_ids == [3]


def test_non_tensor_values_stay_as_decoded_for_the_processor_to_reject():
    outs = EngineCoreOutputs(outputs=[OmniEngineCoreOutput(request_id="a", new_token_ids=[],
                                                           multimodal_output={"audio": "oops", "n": 3})])
    got = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs))
    assert got.outputs[0].multimodal_output == {"audio": "oops", "n": 3}


def packed_frame():
    """A step's worker-accumulated data as the worker lays it out: one uint8 buffer, each key's data
    of every request back to back, one region per key."""
    audio = [torch.randn(1920 * 3), torch.randn(1920)]
    codes = [torch.randint(0, 1024, (3, 8)), torch.randint(0, 1024, (1, 8))]
    a_bytes = torch.cat(audio).view(torch.uint8)
    c_bytes = torch.cat(codes).view(-1).view(torch.uint8)
    buffer = torch.cat([a_bytes, c_bytes])
    regions = [MultimodalRegion("audio", "float32", [], -1, 0, ["a", "b"], [1920 * 3, 1920]),
               MultimodalRegion("codes", "int64", [8], 0, a_bytes.numel(), ["a", "b"], [3, 1])]
    outs = OmniEngineCoreOutputs(outputs=[OmniEngineCoreOutput(request_id=r, new_token_ids=[5]) for r in ("a", "b", "c")],
                                 multimodal_buffer=buffer, multimodal_regions=regions)
    return outs, audio, codes


def test_worker_data_travels_in_one_frame_and_arrives_as_views():
    outs, audio, codes = packed_frame()
    bufs = MsgpackEncoder().encode(outs)
    assert len(bufs) == 2  # the message and the one buffer, however many requests and keys
    got = OmniMsgpackDecoder().decode([bytes(b) for b in bufs])
    for eco, a, c in zip(got.outputs, audio, codes):
        (axis_a, t_a), (axis_c, t_c) = eco.multimodal_delivered["audio"], eco.multimodal_delivered["codes"]
        assert torch.equal(t_a, a) and axis_a == -1 and torch.equal(t_c, c) and axis_c == 0
        assert t_a.untyped_storage().data_ptr() == got.multimodal_buffer.untyped_storage().data_ptr()
    assert got.outputs[2].multimodal_delivered is None  # a request with nothing due
    plain = MsgpackDecoder(EngineCoreOutputs).decode(bufs)  # vLLM's own client decoder drops it all
    assert not hasattr(plain, "multimodal_buffer") and not hasattr(plain.outputs[0], "multimodal_delivered")


@pytest.mark.parametrize("change, message", [
    ({"offset": 10 ** 9}, "does not fit"),
    ({"offset": 2}, "boundary"),
    ({"dtype": "float99"}, "malformed"),
    ({"frames": [3, 1]}, "malformed"),  # two counts for the one request it names
    # one byte past the buffer's end (uint8: any offset is on its boundary); before its start
    ({"dtype": "uint8", "frame": [8], "frames": [1], "offset": 4 * 1920 * 4 + 8 * 8 * 4 - 7}, "does not fit"),
    ({"offset": -192}, "does not fit"),
    ({"frame": [0]}, "malformed"),  # frames of no elements
    ({"frames": [-1]}, "malformed"),
    ({"axis": 1}, "malformed"),  # pieces grow along 0 or -1 only
    # no frames, of frames no tensor can have: fits no buffer however few (int64's range, and past it)
    ({"frame": [2 ** 62, 8], "frames": [0]}, "malformed"),
    ({"frame": [2 ** 63], "frames": [0]}, "malformed"),
    ({"dtype": "qint8", "frame": [], "frames": [3]}, "malformed"),  # (a quantized value is not its bytes alone)
])
@pytest.mark.parametrize("bad_first", [False, True])
def test_a_region_that_does_not_fit_fails_only_the_requests_it_names(change, message, bad_first):
    """Whichever place the bad region has in the message, the regions after it are delivered."""
    outs, audio, codes = packed_frame()
    codes_region = outs.multimodal_regions[1]
    codes_region.request_ids, codes_region.frames = ["a"], [3]  # codes of "a" only
    for name, value in change.items():
        setattr(codes_region, name, value)
    if bad_first:
        outs.multimodal_regions.reverse()
    got = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs))
    bad, good = got.outputs[0], got.outputs[1]
    assert bad.multimodal_delivered is None and message in bad.multimodal_error.message
    assert bad.multimodal_error.key == "codes" and bad.multimodal_error.to_exception("a").request_id == "a"
    assert good.multimodal_error is None and torch.equal(good.multimodal_delivered["audio"][1], audio[1])


@pytest.mark.parametrize("reshape", [lambda flat: flat[0], lambda flat: flat.view(-1, 4),
                                     lambda flat: flat.view(torch.float32)], ids=["0-d", "2-D", "float32"])
def test_a_step_buffer_that_is_not_one_dimensional_bytes_fails_the_requests_of_its_regions(reshape):
    """A 0-d buffer, one of rows (its regions' offsets count bytes) or of another dtype: no region is
    cut from it (a row-sliced one would hand out more bytes than its region names), and every request
    its regions name fails with the key; the message decodes."""
    outs = packed_frame()[0]
    outs.multimodal_buffer = reshape(outs.multimodal_buffer).clone()
    got = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs))
    for eco in got.outputs[:2]:
        assert eco.multimodal_delivered is None and "not 1-D bytes" in eco.multimodal_error.message
    assert got.outputs[2].multimodal_error is None  # a request with nothing due


@pytest.mark.parametrize("split", ["one region", "two regions"])
def test_a_second_piece_of_a_key_for_a_request_in_one_step_fails_it(split):
    """A request's data of a key is one piece a step (the worker's regions name it once): a region
    naming it twice, or two regions of the key naming it, fail it with the key instead of one piece
    replacing the other; the other requests' pieces arrive."""
    from vllm_omni_kernels.vllm_integration.wire import MultimodalRegion

    x = torch.arange(16, dtype=torch.float32)
    regions = ([MultimodalRegion("audio", "float32", [], -1, 0, ["a", "a", "b"], [6, 4, 6])]
               if split == "one region" else
               [MultimodalRegion("audio", "float32", [], -1, 0, ["a", "b"], [6, 6]),
                MultimodalRegion("audio", "float32", [], -1, 48, ["a"], [4])])
    outs = OmniEngineCoreOutputs(outputs=[OmniEngineCoreOutput(request_id=r, new_token_ids=[1]) for r in "ab"],
                                 multimodal_buffer=x.view(torch.uint8).clone(), multimodal_regions=regions)
    a, b = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs)).outputs
    assert a.multimodal_delivered is None and a.multimodal_error.key == "audio"
    assert "two pieces" in a.multimodal_error.message
    want = x[10:16] if split == "one region" else x[6:12]
    assert b.multimodal_error is None and torch.equal(b.multimodal_delivered["audio"][1], want)


def test_a_workers_failure_for_want_of_memory_arrives_as_an_output_memory_error():
    """The worker's ``OutputMemoryError`` (a retry can succeed: vLLM answers 503) stays one across
    the wire, with its key, for the request it names; any other failure is a plain
    ``TensorAccumulationError``."""
    from vllm_omni_kernels.errors import OutputMemoryError, OutputTooLargeError
    from vllm_omni_kernels.vllm_integration.wire import MultimodalError

    errors = {"oom": OutputMemoryError("pool budget spent", request_id="oom", key="audio"),
              "bad": TensorAccumulationError("dtype changed", request_id="bad", key="codes"),
              "large": OutputTooLargeError("more than the budget ever holds", request_id="large", key="audio")}
    outs = OmniEngineCoreOutputs(outputs=[
        OmniEngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=FinishReason.ERROR,
                             multimodal_error=MultimodalError.of(exc)) for rid, exc in errors.items()])
    got = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs))
    oom, bad, large = (eco.multimodal_error.to_exception(eco.request_id) for eco in got.outputs)
    assert isinstance(oom, OutputMemoryError) and oom.request_id == "oom" and oom.key == "audio"
    assert type(bad) is TensorAccumulationError and bad.request_id == "bad" and bad.key == "codes"
    assert type(large) is OutputTooLargeError and large.request_id == "large" and large.key == "audio"


def test_payload_and_completion_round_trip_through_vllm_msgpack():
    payload = MultimodalPayload(tensors={"audio": torch.randn(2, 480), "codes": torch.arange(32).view(2, 16),
                                         "frames": [torch.ones(3), torch.zeros(1, 2)]},
                                metadata={"sr": torch.tensor(24000), "voice": "alto", "speed": 1.25})
    back = decode_payload(encode_payload(payload))
    assert list(back.tensors) == list(payload.tensors) and list(back.metadata) == list(payload.metadata)
    assert torch.equal(back.tensors["audio"], payload.tensors["audio"])
    assert all(torch.equal(a, b) for a, b in zip(back.tensors["frames"], payload.tensors["frames"]))
    assert int(back.metadata["sr"]) == 24000 and back.metadata["voice"] == "alto" and back.metadata["speed"] == 1.25
    assert torch.equal(back.primary_tensor, payload.tensors["audio"])
    comp = MultimodalCompletionOutput(index=1, text="hi", token_ids=[4, 5], cumulative_logprob=-1.5, logprobs=None,
                                      finish_reason="stop", stop_reason=None, multimodal_output=payload)
    out = decode_completion(encode_completion(comp))
    assert (out.index, out.text, list(out.token_ids), out.finish_reason) == (1, "hi", [4, 5], "stop")
    assert torch.equal(out.multimodal_output.tensors["codes"], payload.tensors["codes"])


def test_a_payloads_axes_survive_the_stage_codec_and_its_stereo_pieces_merge_along_time():
    """The axis each tensor grows along travels with the payload: two stereo DELTA pieces ``[2, T]``
    decoded at the next stage merge to ``[2, 2T]`` (without their axes, ``merge`` stacks the second
    piece's channels under the first)."""
    audio = torch.randn(2, 8)
    pieces = [MultimodalPayload({"audio": audio[:, :4], "codes": torch.zeros(1, 16, dtype=torch.int64)},
                                axes={"audio": -1, "codes": 0}),
              MultimodalPayload({"audio": audio[:, 4:], "codes": torch.ones(2, 16, dtype=torch.int64)},
                                axes={"audio": -1, "codes": 0})]
    first, second = (decode_payload(encode_payload(p)) for p in pieces)
    assert first.axes == {"audio": -1, "codes": 0}
    merged = first.merge(second)
    assert torch.equal(merged.tensors["audio"], audio) and merged.tensors["codes"].shape == (3, 16)
    comp = MultimodalCompletionOutput(index=0, text="", token_ids=[1], cumulative_logprob=None, logprobs=None,
                                      multimodal_output=pieces[0])
    assert decode_completion(encode_completion(comp)).multimodal_output.axes == {"audio": -1, "codes": 0}


def test_tensors_inside_a_payloads_plain_values_arrive_as_tensors_between_stages():
    """A payload's list of mixed values and a metadata value holding tensors: each tensor comes back
    a tensor, in its place; the sender's payload is left as it was."""
    emb, part = torch.randn(4), torch.arange(6).view(2, 3)
    payload = MultimodalPayload(tensors={"audio": torch.ones(3), "chunks": [part, "x", (1, part)]},
                                metadata={"sr": 24000, "spk": {"emb": emb, "names": ["a", emb]}})
    back = decode_payload(encode_payload(payload))
    chunks, spk = back.tensors["chunks"], back.metadata["spk"]
    assert torch.equal(chunks[0], part) and chunks[1] == "x" and chunks[2][0] == 1 and torch.equal(chunks[2][1], part)
    assert torch.equal(spk["emb"], emb) and spk["names"][0] == "a" and torch.equal(spk["names"][1], emb)
    assert payload.metadata["spk"]["emb"] is emb and payload.tensors["chunks"][0] is part


@pytest.mark.parametrize("value", ["quantized", "conj", "neg"])
def test_a_tensor_whose_memory_is_not_its_value_is_refused_by_the_engine_cores_check(value):
    """The engine core checks a request's values before vLLM's encoder writes the step's message
    (``tensor_paths(check=True)``, as the scheduler calls it): a quantized tensor, or a lazy
    conjugate or negation (vLLM's encoder reads the memory and raises), is refused there for its
    request and key, where it used to fail the encoding of the whole step."""
    t = {"quantized": torch.quantize_per_tensor(torch.randn(8), 0.05, 3, torch.qint8),
         "conj": torch.randn(8, dtype=torch.complex64).conj(), "neg": torch._neg_view(torch.randn(8))}[value]
    with pytest.raises(TensorAccumulationError, match="strided memory|lazily") as err:
        tensor_paths({"spec": t}, check=True)
    assert err.value.key == "spec"
    assert tensor_paths({"spec": t.resolve_conj().resolve_neg() if value != "quantized" else t.dequantize()},
                        check=True) == [["spec"]]


def test_a_payload_between_stages_carries_a_one_sample_strided_view_and_names_what_it_cannot_carry():
    """``encode_payload`` of a payload with a tensor of one element or none whose memory is strided
    (torch counts it contiguous; vLLM's encoder refused its bytes with a RuntimeError) carries its
    value; a lazily conjugated one is refused with a ``TensorAccumulationError`` naming its key, as
    the engine core's check refuses it (it was a RuntimeError from inside vLLM's encoder)."""
    wav = torch.randn(48, 2)
    one, none = wav.t()[0][10:11], wav.t()[1][4:4]
    payload = MultimodalPayload(tensors={"audio": one, "parts": [one, torch.ones(2)]},
                                metadata={"empty": none, "deep": {"x": one}}, axes={"audio": -1})
    back = decode_payload(encode_payload(payload))
    assert torch.equal(back.tensors["audio"], one) and torch.equal(back.tensors["parts"][0], one)
    assert back.metadata["empty"].shape == (0,) and torch.equal(back.metadata["deep"]["x"], one)
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    with pytest.raises(TensorAccumulationError, match="lazily") as err:
        encode_payload(MultimodalPayload(tensors={"audio": torch.ones(2), "spec": [z]}))
    assert err.value.key == "spec"


@pytest.mark.parametrize("bad, message", [
    (["qint8", [4], 1], "a list where the message has a tensor"),  # a quantized dtype's name
    (["float32", [999], 1], "needs 3996 bytes"),   # shape not matching its buffer
    (["float32", [4], 99], "outside the message"),  # aux index out of range
    (["float32", [4], {"handle": 1}], "not a buffer"),  # dict data (an out-of-band tensor we never send)
    (["float32", [0, 2 ** 62, 2 ** 62], b""], "of shape [0, "),  # no bytes, but strides no tensor can have
])
def test_a_malformed_tensor_is_an_error_for_its_request_only(bad, message):
    outs, audio, codes, sr = frame()
    outs.outputs.insert(1, OmniEngineCoreOutput(request_id="bad", new_token_ids=[3],
                                                multimodal_output={"audio": bad, "sr": 16000},
                                                multimodal_tensors=[["audio"]]))  # as a damaged frame
    got = OmniMsgpackDecoder().decode(MsgpackEncoder().encode(outs))
    tts, broken, text, quiet = got.outputs
    assert torch.equal(tts.multimodal_output["audio"], audio) and torch.equal(tts.multimodal_output["codes"], codes)
    err = broken.multimodal_output["audio"]
    assert isinstance(err, TensorAccumulationError) and err.request_id == "bad" and err.key == "audio"
    assert message in str(err) and broken.multimodal_output["sr"] == 16000 and broken.new_token_ids == [3]
    assert text.finish_reason == FinishReason.STOP


def test_a_key_whose_first_nested_tensor_is_malformed_keeps_the_reason_why():
    """A key holding several tensors whose first cannot be restored (its buffer is not in the
    message) fails with that reason; the key's later tensors do not replace it with another."""
    big = torch.arange(4096, dtype=torch.float32)  # large enough to travel in a buffer of its own
    eco = OmniEngineCoreOutput(request_id="a", new_token_ids=[1], multimodal_output={"extra": {"p": big, "q": big + 1}})
    frames = list(MsgpackEncoder().encode(OmniEngineCoreOutputs(outputs=[eco])))
    assert len(frames) > 1
    err = OmniMsgpackDecoder().decode(frames[:1]).outputs[0].multimodal_output["extra"]
    assert isinstance(err, TensorAccumulationError) and "outside the message" in str(err), err

