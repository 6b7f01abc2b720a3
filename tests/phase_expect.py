"""The expected outcome of a fake-runner step, computed straight from the contract (the oracle)."""

from __future__ import annotations

import numpy as np

from phase_fakes import codes_of, decode_embed, decode_id, mtp_embed, mtp_hidden, mtp_text, prompt_embed


def expected_step(runner, rows, offsets=None):
    """(input_ids, inputs_embeds, hook calls, {rid: codes}) the step must produce."""
    model = runner.model
    h, t = model.hidden, runner.max_tokens
    ids = np.full(t, 7, np.int64)
    emb = np.full((t, h), -1, np.float32)
    spans = [s for _, _, s in rows]
    starts = list(np.concatenate(([0], np.cumsum(spans)[:-1]))) if offsets is None else offsets
    calls, run, codes = [], [], {}

    def flush():
        if run:
            calls.append(("batch", [r for r, _ in run]))
            run.clear()

    for (rid, c, span), s in zip(rows, starts):
        prefill = c < runner.requests[rid].num_prompt_tokens
        single = span == 1 and not prefill
        if model.batch_hook and single:
            run.append((rid, c))
        else:
            flush()
            calls.append(("scalar", rid))
        if prefill:
            emb[s:s + span] = prompt_embed(rid, np.arange(c, c + span), h)
            continue
        ids[s:s + span] = [decode_id(rid, c + k) for k in range(span)]
        d = np.concatenate([decode_embed(rid, c + k, h) for k in range(span)]) if span else np.zeros((0, h))
        if single and model.mtp:
            emb[s] = mtp_embed(d, mtp_hidden(rid, h), mtp_text(rid, c, h))[0]
            codes[rid] = codes_of(np.array([decode_id(rid, c)]))
        else:
            emb[s:s + span] = d
    flush()
    return ids, emb, calls, codes


def hook_calls(model):
    """The fake model's calls reduced to (kind, rid or [rids])."""
    return [(c[0], c[1]) for c in model.calls]
