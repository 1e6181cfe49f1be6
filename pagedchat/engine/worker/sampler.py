import torch

from pagedchat.engine.core.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> list[int]:
    """One token per row of logits [N, vocab] for the sequence of that row, under its SamplingParams."""
    logits = logits.float()
    for row, seq in enumerate(seqs):
        params = seq.params
        if seq.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
            logits[row, banned] = float("-inf")
    if any(seq.params.penalised for seq in seqs):
        logits = apply_penalties(logits, seqs)
    greedy = torch.tensor([seq.params.greedy for seq in seqs])
    tokens = logits.argmax(dim=-1)
    if not greedy.all():
        rows = (~greedy).nonzero().squeeze(1)
        chosen = _sample_rows(logits[rows], [seqs[i] for i in rows.tolist()])
        tokens[rows] = chosen
    return tokens.tolist()


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """vLLM's order: the repetition penalty over each sequence's tokens (all turns: prompt and output),
    then frequency and presence over its current turn's output. Only the rows that ask are touched."""
    repeat = [row for row, seq in enumerate(seqs) if seq.params.repetition_penalty != 1]
    if repeat:
        seen = _token_counts(logits, [seqs[row].token_ids for row in repeat]) > 0
        penalty = _column([seqs[row].params.repetition_penalty for row in repeat], logits)
        rows = logits[repeat]
        penalised = torch.where(rows > 0, rows / penalty, rows * penalty)
        logits[repeat] = torch.where(seen, penalised, rows)
    counted = [row for row, seq in enumerate(seqs) if seq.params.presence_penalty or seq.params.frequency_penalty]
    if counted:
        counts = _token_counts(logits, [seqs[row].output_token_ids for row in counted])
        frequency = _column([seqs[row].params.frequency_penalty for row in counted], logits)
        presence = _column([seqs[row].params.presence_penalty for row in counted], logits)
        logits[counted] -= frequency * counts + presence * (counts > 0)
    return logits


def _token_counts(logits: torch.Tensor, token_lists: list[list[int]]) -> torch.Tensor:
    """[len(token_lists), vocab]: how often each token occurs in each list."""
    device = logits.device
    counts = torch.zeros(len(token_lists), logits.shape[1], dtype=logits.dtype, device=device)
    tokens = torch.tensor([token for t in token_lists for token in t], dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device),
                                   torch.tensor([len(t) for t in token_lists], device=device))
    counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=logits.dtype), accumulate=True)
    return counts


def _column(values: list[float], logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=logits.dtype, device=logits.device).unsqueeze(1)


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([seq.params.temperature for seq in seqs], device=device).unsqueeze(1)
    logits = logits / temperature
    top_k = torch.tensor([seq.params.top_k or logits.shape[1] for seq in seqs], device=device)
    top_p = torch.tensor([seq.params.top_p for seq in seqs], device=device)
    if (top_k < logits.shape[1]).any() or (top_p < 1).any():
        logits = _filter_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    # The exponential race (argmax of p / Exp(1)) draws from probs; its noise comes from each
    # sequence's own generator, so a seeded request samples the same tokens whatever its batch.
    # The generators are CPU ones: the noise is drawn there, so a seed gives the same tokens on any device.
    noise = torch.stack([torch.empty(probs.shape[1]).exponential_(generator=seq.generator) for seq in seqs])
    noise = noise.to(device)
    return (probs / noise).argmax(dim=-1)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Keep the smallest set whose probability reaches top_p: drop a token once the mass before it does.
    drop |= (cumulative - sorted_logits.softmax(dim=-1)) >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
