from pagedchat.engine.core.sequence import Sequence


def detokenize_step(tokenizer, seq: Sequence) -> str:
    """Text added by seq's newest tokens, held back while a character is still split across tokens."""
    ids = seq.output_token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=True)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return full[len(prefix) :]
    return ""


def flush(tokenizer, seq: Sequence) -> str:
    """At the end of a turn: whatever is still held back (an incomplete character shows as U+FFFD)."""
    full = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    return full[len(seq.text) :] if full.startswith(seq.text) else ""
