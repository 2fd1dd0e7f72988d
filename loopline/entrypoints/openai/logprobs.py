"""Engine logprobs (vLLM shape: per token ``{token_id: Logprob}``) in the two OpenAI formats."""
from __future__ import annotations

from loopline.entrypoints.openai.protocol import ChatTokenLogprob, CompletionLogProbs, TopLogprob
from loopline.outputs import Logprob


_MIN_LOGPROB = -9999.0  # JSON has no -inf (a token outside top-k/top-p under processed_logprobs)


def finite(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


def token_str(token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return f"token_id:{token_id}"


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None],
                        start_offset: int = 0) -> CompletionLogProbs:
    """Legacy format: parallel ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset`` lists.

    ``entries[i]`` is ``None`` where no logprob exists (the first prompt
    position under ``echo``). ``top_logprobs[i]`` holds the top k and the
    sampled token, as vLLM does.
    """
    out = CompletionLogProbs()
    offset = start_offset
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid) if entry else None
        tok = token_str(tid, lp)
        out.tokens.append(tok)
        out.token_logprobs.append(finite(lp.logprob) if lp is not None else None)
        out.top_logprobs.append({token_str(t, v): finite(v.logprob) for t, v in entry.items()} if entry else None)
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_k: int) -> list[ChatTokenLogprob]:
    """Chat format: one ``{token, logprob, bytes, top_logprobs}`` per token, ``top_logprobs`` ranked, at most k."""
    content = []
    for tid, entry in zip(token_ids, entries):
        lp = entry[tid]
        ranked = sorted((v.rank if v.rank is not None else 1 << 30, t, v) for t, v in entry.items())
        top = [_top(t, v) for rank, t, v in ranked if rank <= top_k][:top_k]
        chosen = _top(tid, lp)
        content.append(ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes, top_logprobs=top))
    return content


def _top(token_id: int, lp: Logprob) -> TopLogprob:
    tok = token_str(token_id, lp)
    return TopLogprob(token=tok, logprob=finite(lp.logprob), bytes=list(tok.encode("utf-8")))
