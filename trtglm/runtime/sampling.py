"""Choosing the next token from logits by TensorRT-LLM's rules, every row of a step in one batched pass.

Logits processors run first, in TensorRT-LLM's order: the request's embedding bias is added, its
penalties are applied (`penalised`), then banned ids get -inf: a one-token bad word always, a longer
one when the sequence ends with all but its last token, `end_id` and one-token stop words until
`min_tokens` tokens exist. A greedy row (temperature 0 or top_k 1) then takes its argmax; a sampled
row divides by its temperature, keeps its top-k, then its top-p, and draws by the Gumbel-max rule
with noise of its own (gumbel.py: the request's seed and draw count, so the same seed gives the same
tokens whatever else shares the step). The log probability returned is the chosen token's under
the distribution it was chosen from after bias, penalties, bans and temperature (top-k and top-p
not applied). Beam search, which does not sample, is beams.py; `processed` gives its rows the same
processing.

`TokenChooser` holds each slot's settings as device tensors, written when a request is admitted to
the slot, so that a step's choice is a few batched kernels over `[rows, vocab]` and one host
transfer carrying every row's token, log probability and error together, whatever the mix of
greedy, sampled, penalised and banned rows. Work a step needs for none of its rows is skipped: a
batch of plain greedy rows is one argmax.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trtglm.errors import UsageError
from trtglm.request_config import OutputConfig, SamplingConfig
from trtglm.runtime.gumbel import gumbel_argmax
from trtglm.runtime.request import Request
from trtglm.runtime.transfer import Download, upload

NEG_INF = float("-inf")
# the errors a row's processed logits can give (a row's code in `TokenChooser.choose`'s transfer)
ROW_ERRORS = {1: "every token is excluded (embedding_bias of -inf, or bad_words covering them all)",
              2: "the logits hold NaN (an embedding_bias of NaN?)"}


# --- the logits processors, on [rows, vocab] ---------------------------------------------------------------


def penalised(logits: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor, presence: torch.Tensor,
              frequency: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM's repetition, presence and frequency penalties of each row (`[rows]` each) over `counts`
    (float32 `[rows, vocab]`: how often each id occurs in the row's sequence, prompt included).

    A logit of an id that occurs is divided by `repetition` when positive and multiplied by it when negative,
    then lowered by `presence` once and by `frequency` for each occurrence. TensorRT-LLM applies them to logits
    already divided by the temperature, and the sampler here divides afterwards, so the presence and
    frequency given are to be taken `temperature` times (`penalty_scale`): the same distribution."""
    repetition, presence, frequency = repetition[:, None], presence[:, None], frequency[:, None]
    adjusted = torch.where(logits > 0, logits / repetition, logits * repetition) - presence - frequency * counts
    return torch.where(counts > 0, adjusted, logits)


def penalty_scale(sampling: SamplingConfig) -> float:
    """What the presence and frequency penalties are multiplied by (see `penalised`): the temperature, or 1 when
    it is 0 (the logits are then not divided)."""
    return sampling.temperature if sampling.temperature > 0 else 1.0


def id_counts(ids: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 `[vocab]`: how often each id below `vocab` occurs in `ids`."""
    ids = upload([int(t) for t in ids if 0 <= int(t) < vocab], torch.device(device))
    return torch.bincount(ids, minlength=vocab).to(torch.float32)


def top_k_top_p(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                candidates: int | None = None, by_k: bool = True, by_p: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each row's scores (its `logits` less their maximum over its `temperature`, `[rows, 1]`), most likely
    first, with the ids past its top-k (ties with the k-th kept; 0: off) and then past its top-p at -inf (kept:
    the most likely whose probabilities, renormalised after top-k, sum to at least top_p, at least one); the ids
    of those columns; and (with `candidates`) whether each row kept nothing outside them. `by_k`, `by_p` False:
    no row has a top-k, a top-p (that work is skipped).

    `candidates`: only each row's most likely `candidates` ids are looked at (a top-k selection instead of a
    full sort); a row that may keep more (top-p mass outside them, a tie with the last, no top-k nor top-p) is
    not `covered`, and its result is not to be used. The order is the logits' (a temperature keeps it), so
    only the columns looked at are scaled."""
    width = logits.shape[-1]
    ordered, ids = logits.topk(candidates, dim=-1) if candidates else logits.sort(dim=-1, descending=True)
    top = ordered[:, :1]
    ordered = (ordered - top) / temperature
    k, p = top_k[:, None], top_p[:, None]
    kth = torch.where(k > 0, ordered.gather(1, (k - 1).clamp(0, ordered.shape[-1] - 1)), NEG_INF) if by_k else None
    if by_k:
        ordered = ordered.masked_fill(ordered < kth, NEG_INF)
    probs = None
    if by_p:  # probabilities after top-k: over its top-k ids, or (top-k off) over all the row's ids
        if candidates:
            kept = torch.exp(ordered)
            whole = torch.exp((logits - top) / temperature).sum(dim=-1, keepdim=True)
            probs = kept / (torch.where(k > 0, kept.sum(dim=-1, keepdim=True), whole) if by_k else whole)
        else:
            probs = torch.softmax(ordered, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the mass of the strictly more likely ids
        ordered = ordered.masked_fill((before >= p) & (p < 1), NEG_INF)
    if not candidates or candidates >= width:
        return ordered, ids, None
    whole_top_k = (k > 0) & (k <= candidates) & (ordered[:, -1:] < kth) if by_k else torch.zeros_like(k, dtype=bool)
    if not by_p:
        return ordered, ids, whole_top_k[:, 0]
    covered = torch.where(k > 0, whole_top_k, (p < 1) & (probs.sum(dim=-1, keepdim=True) >= p))
    return ordered, ids, covered[:, 0]


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`logits` over each row's `temperature` (`[rows, 1]`), less their maximum first: a tiny temperature then
    gives -inf for all but the most likely ids, not several infinities."""
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature


def row_errors(logits: torch.Tensor) -> torch.Tensor:
    """Each row's error code (ROW_ERRORS; 0: a token can be chosen)."""
    nan = torch.isnan(logits).any(dim=-1)
    excluded = ~torch.isfinite(logits).any(dim=-1)
    return torch.where(nan, 2, torch.where(excluded, 1, 0))


def raise_for(codes: torch.Tensor) -> None:
    """UsageError for the first row whose error code is not 0."""
    for code in codes.tolist():
        if code:
            raise UsageError(ROW_ERRORS[code])


def processed(logits: torch.Tensor, bias: torch.Tensor | None, banned: Sequence[Sequence[int]],
              penalties: tuple[float, float, float] | None = None, histories: Sequence[Sequence[int]] = ()
              ) -> torch.Tensor:
    """float32 `logits` `[rows, vocab]` with the embedding bias added, the (repetition, presence, frequency)
    `penalties` applied over each row's history, and each row's `banned` ids at -inf (a beam search's rows,
    offline generation); UsageError when that leaves a row nothing to choose."""
    logits = logits.float()
    vocab = logits.shape[-1]
    if bias is not None:
        width = min(bias.numel(), vocab)  # past the tokenizer's ids logits are cut off
        logits = logits.clone()
        logits[:, :width] += bias[:width].to(device=logits.device, dtype=torch.float32)
    if penalties is not None:
        counts = torch.stack([id_counts(history, vocab, logits.device) for history in histories])
        logits = penalised(logits, counts, *(torch.full((len(logits),), value, device=logits.device)
                                             for value in penalties))
    pairs = [(row, int(t)) for row, ids in enumerate(banned) for t in ids if int(t) < vocab]
    if pairs:
        rows, ids = zip(*pairs)
        logits = logits.index_put((torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device)),
                                  torch.tensor(NEG_INF, device=logits.device))
    raise_for(row_errors(logits))
    return logits


class BadWords:
    """The ids that a request's bad words ban after a given history."""

    def __init__(self, words: Sequence[Sequence[int]]):
        self.always = sorted({int(w[-1]) for w in words if len(w) == 1})
        self.after = [([int(t) for t in w[:-1]], int(w[-1])) for w in words if len(w) > 1]

    def banned_after(self, history: Sequence[int]) -> list[int]:
        """The last ids of the longer words whose other ids end `history`."""
        return [last for prefix, last in self.after if list(history[-len(prefix):]) == prefix]

    def banned(self, history: Sequence[int]) -> list[int]:
        return self.always + self.banned_after(history)


def held_until_min_tokens(end_id: int | None, stop_words: Sequence[Sequence[int]]) -> list[int]:
    """The ids banned while a sequence is shorter than its `min_tokens`: the end id, as TensorRT-LLM bans it,
    and every one-token stop word (ChatGLM3's `<|user|>` and `<|observation|>` end its replies as `</s>` does;
    vLLM's `min_tokens` holds stop token ids back too). Longer stop words are not held back."""
    return ([end_id] if end_id is not None else []) + [int(word[0]) for word in stop_words if len(word) == 1]


# --- every row of a step at once -------------------------------------------------------------------------


def needs(request: Request, words: BadWords, held: list[int]) -> set[str]:
    """The kinds of processing a request's rows need (a step does only what some row of it needs)."""
    sampling, sampled = request.sampling, not request.sampling.greedy
    return {name for name, used in (
        ("sampled", sampled), ("top", sampled and (sampling.top_k > 0 or sampling.top_p < 1)),
        ("top_k", sampled and sampling.top_k > 0), ("top_p", sampled and sampling.top_p < 1),
        ("penalised", sampling.penalised), ("added", request.embedding_bias is not None or bool(words.always)),
        ("held", sampling.min_tokens > 0 and bool(held)), ("words", bool(words.after)),
        ("log_probs", request.output.return_log_probs)) if used}


CANDIDATES = 16  # ids looked at first for top-k and top-p on a CPU (TokenChooser._draw)
CHECKED_USES = ("added", "words", "held")  # what can leave a row nothing to choose: its rows' logits are checked
# columns of TokenChooser's per-slot tables
TEMPERATURE, TOP_P, REPETITION, PRESENCE, FREQUENCY = range(5)  # floats: the divisor (1 when greedy), ...
TOP_K, SEED, DRAWN, MIN_TOKENS, SAMPLED, CHECKED, LOG_PROBS = range(7)  # ints: ..., tokens drawn so far, flags


@dataclass
class _Slot:
    """What the host keeps of a slot's request: which processing it needs, and its longer bad words."""

    uses: frozenset[str]
    words: BadWords
    history: list[int]  # the executor's list: prompt and generated ids
    top_k: int  # 0 unless sampled


class Chosen:
    """A step's choice on its way to the host: `result()` waits for it (see `TokenChooser.choose`)."""

    def __init__(self, rows: int, columns: dict[str, torch.Tensor]):
        self.rows, self.names = rows, list(columns)
        self._download = Download(torch.stack([c.double() for c in columns.values()]))

    def result(self) -> tuple[list[int], list[float], list[str | None]]:
        host = dict(zip(self.names, self._download.values()))
        return ([int(t) for t in host["token"]], host.get("log_prob", [0.0] * self.rows),
                [ROW_ERRORS.get(int(code)) for code in host.get("error", [0] * self.rows)])


class TokenChooser:
    """The token choice of up to `slots` requests at once, each request's settings held in its slot (see the
    module docstring). `vocab`: ids from it on (an engine's padding past its tokenizer's) are never chosen."""

    def __init__(self, slots: int, vocab: int, device: torch.device | str = "cpu"):
        self.slots, self.vocab, self.device = slots, vocab, torch.device(device)
        self.floats = torch.ones(slots, 5, device=self.device)
        self.ints = torch.zeros(slots, 7, dtype=torch.int64, device=self.device)
        # [slots, vocab] tables, made when a request first needs them
        self.counts: torch.Tensor | None = None  # float32: ids each penalised slot's sequence holds
        self.added: torch.Tensor | None = None  # float32: embedding bias, -inf at one-token bad words
        self.held: torch.Tensor | None = None  # bool: ids banned until min_tokens
        self._slots: dict[int, _Slot] = {}
        self._uses: Counter[str] = Counter()  # how many occupied slots need each kind of processing
        self._top_ks: Counter[int] = Counter()  # how many occupied slots sample with each top_k
        self.last_tokens = torch.zeros(slots, dtype=torch.int64, device=self.device)  # each slot's newest token

    def admit(self, slot: int, request: Request, history: list[int]) -> None:
        """Write the settings of `request`, whose prompt and generated ids `history` holds, into `slot`."""
        self.release(slot)
        sampling, words = request.sampling, BadWords(request.bad_words)
        held = [t for t in held_until_min_tokens(request.end_id, request.stop_words) if t < self.vocab]
        uses = needs(request, words, held)
        sampled, scale = "sampled" in uses, penalty_scale(sampling)
        seed = sampling.seed if sampling.seed is not None else random.randrange(2**63)
        self.floats[slot].copy_(upload([sampling.temperature if sampled else 1.0, sampling.top_p,
                                        sampling.repetition_penalty, sampling.presence_penalty * scale,
                                        sampling.frequency_penalty * scale], self.device, torch.float32))
        self.ints[slot].copy_(upload([sampling.top_k if sampled else 0, seed - 2**64 if seed >= 2**63 else seed, 0,
                                      sampling.min_tokens, int(sampled), int(bool(uses & set(CHECKED_USES))),
                                      int(request.output.return_log_probs)], self.device))
        self._write_rows(slot, request, uses, words.always, held)
        self._slots[slot] = _Slot(frozenset(uses), words, history, sampling.top_k if sampled else 0)
        self._uses.update(uses)
        self._top_ks[self._slots[slot].top_k] += 1

    def _write_rows(self, slot: int, request: Request, uses: set[str], banned: list[int], held: list[int]) -> None:
        """The slot's rows of the `[slots, vocab]` tables its request needs (its `added` row zeroed otherwise)."""
        if "penalised" in uses:
            self._table("counts", torch.float32)[slot] = id_counts(request.prompt, self.vocab, self.device)
        if "added" in uses:
            row = self._table("added", torch.float32)[slot]
            row.zero_()
            if request.embedding_bias is not None:
                width = min(request.embedding_bias.numel(), self.vocab)
                row[:width] = request.embedding_bias[:width].to(device=self.device, dtype=torch.float32)
            row[upload([t for t in banned if t < self.vocab], self.device)] = NEG_INF
        elif self.added is not None:
            self.added[slot].zero_()
        if "held" in uses:
            row = self._table("held", torch.bool)[slot]
            row.zero_()
            row[upload(held, self.device)] = True

    def release(self, slot: int) -> None:
        """The slot's request is gone."""
        gone = self._slots.pop(slot, None)
        if gone is not None:
            self._uses.subtract(gone.uses)
            self._top_ks[gone.top_k] -= 1

    def release_all(self) -> None:
        self._slots.clear()
        self._uses.clear()
        self._top_ks.clear()

    def warm_up(self) -> None:
        """Choose once with each kind of request settings (greedy, sampled by temperature alone, within a top-k and a
        top-p, penalised, with log probabilities) so that serving compiles no kernel for them."""
        kinds = [SamplingConfig(), SamplingConfig(temperature=0.8, seed=0),
                 SamplingConfig(temperature=0.8, top_k=50, top_p=0.8, seed=0, repetition_penalty=1.1)]
        logits = torch.zeros(1, self.vocab, device=self.device)
        for sampling in kinds:
            for log_probs in (False, True):
                request = Request([0], 1, sampling=sampling, output=OutputConfig(return_log_probs=log_probs))
                self.admit(0, request, [0])
                self.choose([0], logits)
                self.release(0)

    def choose(self, slots: Sequence[int], logits: torch.Tensor) -> tuple[list[int], list[float], list[str | None]]:
        """The next token of the request in each of `slots` from its row of `logits` (`[rows, ≥ vocab]`), its log
        probability (0.0 unless asked for) and the error that ends that request alone (None: none), in one
        batched pass and one host transfer."""
        return self.choose_later(slots, logits).result()

    def choose_later(self, slots: Sequence[int], logits: torch.Tensor) -> Chosen:
        """`choose`, launched: the choice is queued on the device (each slot's token also goes to `last_tokens`,
        where the next step reads it) and its results reach the host when `Chosen.result()` asks."""
        rows = self._rows(slots)
        logits = logits[:, :self.vocab].float()
        if not any(self._uses.values()):  # plain greedy rows: the argmax of the model's logits
            tokens = logits.argmax(dim=-1)
            self._advance(rows, tokens)
            return Chosen(len(slots), {"token": tokens})
        floats, ints = self.floats[rows], self.ints[rows]
        logits = self._processed(logits, rows, slots, floats, ints)
        temperature, scaled = floats[:, TEMPERATURE:TEMPERATURE + 1], logits
        if not self._uses["sampled"]:
            tokens = logits.argmax(dim=-1)
        else:
            sampled = ints[:, SAMPLED].bool()
            if self._uses["log_probs"] or self._uses["top"] < self._uses["sampled"]:
                scaled = scaled_logits(logits, temperature)
            tokens = self._draw(logits, scaled, temperature, ints[:, TOP_K], floats[:, TOP_P], ints, sampled)
            if self._uses["sampled"] < len(self._slots):  # greedy rows too
                tokens = torch.where(sampled, tokens, logits.argmax(dim=-1))
        columns = {"token": tokens}
        if any(self._uses[name] for name in CHECKED_USES):
            columns["error"] = row_errors(logits) * ints[:, CHECKED]
        if self._uses["log_probs"]:
            log_probs = torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None])[:, 0]
            columns["log_prob"] = torch.where(ints[:, LOG_PROBS].bool(), log_probs, 0.0)
        self._advance(rows, tokens)
        return Chosen(len(slots), columns)

    def _draw(self, logits: torch.Tensor, scaled: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor, ints: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """Each row's draw from its logits over its temperature (`scaled`, when computed) within its top-k and
        top-p (gumbel.py).

        A CPU sorts row by row, slowly: there each row's most likely CANDIDATES ids (or the largest top-k) are
        looked at first, and only the sampled rows that may keep more are sorted whole. A GPU sorts the batch at
        once (checking which rows need it would cost a wait for the step's result)."""
        seeds, drawn = ints[:, SEED], ints[:, DRAWN]
        if not self._uses["top"]:
            return gumbel_argmax(scaled, seeds, drawn)
        by = {"by_k": self._uses["top_k"] > 0, "by_p": self._uses["top_p"] > 0}
        if self.device.type != "cpu":
            scores, ids, _ = top_k_top_p(logits, temperature, top_k, top_p, **by)
            return gumbel_argmax(scores, seeds, drawn, ids)
        largest = max((k for k, n in self._top_ks.items() if n > 0), default=0)
        # top-k alone needs each row's top-k and one more (a tie with the k-th); top-p may need more
        candidates = min(self.vocab, largest + 1 if self._uses["top_k"] == self._uses["sampled"] else
                         max(CANDIDATES, largest + 1))
        scores, ids, covered = top_k_top_p(logits, temperature, top_k, top_p, candidates, **by)
        tokens = gumbel_argmax(scores, seeds, drawn, ids)
        rest = (sampled & ~covered).nonzero()[:, 0] if covered is not None else []
        if len(rest):
            scores, ids, _ = top_k_top_p(logits[rest], temperature[rest], top_k[rest], top_p[rest], **by)
            tokens[rest] = gumbel_argmax(scores, seeds[rest], drawn[rest], ids)
        return tokens

    def _rows(self, slots: Sequence[int]) -> torch.Tensor:
        """The slots as a device index (uploaded without waiting for the step's pass)."""
        return upload(list(slots), self.device)

    def _processed(self, logits: torch.Tensor, rows: torch.Tensor, slots: Sequence[int], floats: torch.Tensor,
                   ints: torch.Tensor) -> torch.Tensor:
        """The rows' logits with their bias added, penalties applied and banned ids at -inf."""
        if self._uses["added"]:
            logits = logits + self.added[rows]
        if self._uses["penalised"]:
            logits = penalised(logits, self.counts[rows], floats[:, REPETITION], floats[:, PRESENCE],
                               floats[:, FREQUENCY])
        if self._uses["held"]:
            holding = (ints[:, DRAWN] < ints[:, MIN_TOKENS])[:, None]
            logits = logits.masked_fill(self.held[rows] & holding, NEG_INF)
        if self._uses["words"]:
            logits = self._ban_longer_words(logits, slots)
        return logits

    def _ban_longer_words(self, logits: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
        """The last id of each longer bad word whose other ids end its row's history at -inf (host work only for
        the slots that have such words)."""
        row_of = {slot: row for row, slot in enumerate(slots)}
        pairs = [(row_of[slot], t) for slot, state in self._slots.items() if slot in row_of and "words" in state.uses
                 for t in state.words.banned_after(state.history) if t < self.vocab]
        if not pairs:
            return logits
        rows, ids = (torch.tensor(column, device=logits.device) for column in zip(*pairs))
        return logits.index_put((rows, ids), torch.tensor(NEG_INF, device=logits.device))

    def set_last_tokens(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        """The newest token of each of `slots` (chosen elsewhere: a beam search's)."""
        self.last_tokens.index_copy_(0, upload(list(slots), self.device), upload(list(tokens), self.device))

    def _advance(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the chosen tokens (each row's draws, and the ids a penalised sequence holds) and keep them where the
        next step reads its input."""
        self.last_tokens.index_copy_(0, rows, tokens)
        self.ints[:, DRAWN].index_add_(0, rows, torch.ones_like(rows))
        if self._uses["penalised"]:
            self.counts.index_put_((rows, tokens), torch.ones(len(rows), device=self.device), accumulate=True)

    def _table(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if getattr(self, name) is None:
            setattr(self, name, torch.zeros(self.slots, self.vocab, dtype=dtype, device=self.device))
        return getattr(self, name)
