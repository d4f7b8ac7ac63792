"""The batched token choice (trtglm.runtime.sampling.TokenChooser) and its noise (trtglm.runtime.gumbel).

A step's rows are chosen together whatever their settings: each row gets exactly what it gets alone (the same
seed, the same tokens), greedy rows the argmax of their processed logits, and every row the log-softmax of its
processed (and temperature-scaled) logits at the chosen token. The Gumbel-max draw samples the distribution it is
given (frequencies against probabilities), and the GPU kernel draws the same noise as the torch ops."""

from __future__ import annotations

import math
import os

import pytest
import torch

from trtglm.request_config import OutputConfig, SamplingConfig
from trtglm.runtime import gumbel
from trtglm.runtime.request import Request
from trtglm.runtime.sampling import BadWords, TokenChooser, held_until_min_tokens, id_counts, penalised

VOCAB = 96
PROMPT = [5, 9, 9, 14, 30]
END, STOP = 2, 7
ROWS = {  # name: (request settings, what the row's processing needs)
    "greedy": {},
    "sampled": {"sampling": SamplingConfig(temperature=1.3, seed=11)},
    "top-k": {"sampling": SamplingConfig(temperature=0.9, top_k=5, seed=12)},
    "top-p": {"sampling": SamplingConfig(temperature=0.8, top_p=0.8, seed=13)},
    "top-k and top-p": {"sampling": SamplingConfig(temperature=2.0, top_k=20, top_p=0.5, seed=14)},
    "penalised": {"sampling": SamplingConfig(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)},
    "penalised, sampled": {"sampling": SamplingConfig(temperature=1.1, repetition_penalty=1.2, presence_penalty=1.0,
                                                      seed=15)},
    "banned": {"bad_words": [[40], [41], [9, 42]]},
    "biased": {"embedding_bias": torch.linspace(-3.0, 3.0, VOCAB + 8)},  # longer than the vocabulary
    "min tokens": {"sampling": SamplingConfig(min_tokens=3)},
    "log-probs, greedy": {"output": OutputConfig(return_log_probs=True)},
    "log-probs, sampled": {"sampling": SamplingConfig(temperature=0.7, top_p=0.9, seed=16),
                           "output": OutputConfig(return_log_probs=True)},
}
STEPS = 6


def request(name: str) -> Request:
    return Request(PROMPT, STEPS, end_id=END, stop_words=[[STOP]], **ROWS[name])


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


def step_logits(step: int, rows: int) -> torch.Tensor:
    """Each step's logits: the same row for every request (so any difference comes from the choice), peaked
    at the end id and the stop word so that the min-tokens row must hold them back."""
    row = torch.randn(VOCAB + 4, generator=torch.Generator().manual_seed(100 + step)) * 2  # padding past VOCAB
    row[[END, STOP]] += 8.0
    return row.expand(rows, -1).clone()


def run(names: list[str], slots: list[int] | None = None,
        device: str = "cpu") -> dict[str, list[tuple[int, float, str | None]]]:
    """(token, log prob, error) of each step of the requests `names`, chosen together in `slots` on `device`."""
    slots = slots or list(range(len(names)))
    chooser, histories = TokenChooser(max(slots) + 1, VOCAB, device), {}
    for name, slot in zip(names, slots):
        histories[name] = list(PROMPT)
        chooser.admit(slot, request(name), histories[name])
    chosen = {name: [] for name in names}
    for step in range(STEPS):
        tokens, log_probs, errors = chooser.choose(slots, step_logits(step, len(slots)).to(device))
        for name, token, log_prob, error in zip(names, tokens, log_probs, errors):
            chosen[name].append((token, log_prob, error))
            histories[name].append(token)
    return chosen


@pytest.mark.parametrize("device", DEVICES)
def test_every_row_of_a_mixed_batch_gets_what_it_gets_alone(device):
    names = list(ROWS)
    together = run(names, slots=[3 * i + 1 for i in range(len(names))], device=device)  # slots need not be 0..n-1
    for name in names:
        assert together[name] == run([name], device=device)[name], name
    sampled = [name for name in names if request(name).sampling.temperature > 0]
    assert len({tuple(t for t, _, _ in together[name]) for name in sampled}) == len(sampled)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_chooses_what_the_cpu_chooses():
    """The GPU's full sort and Triton draw, the CPU's candidates and numpy draw: the same tokens; log probs to
    float32 rounding."""
    on_cpu, on_gpu = run(list(ROWS)), run(list(ROWS), device="cuda")
    for name in ROWS:
        assert [t for t, _, _ in on_gpu[name]] == [t for t, _, _ in on_cpu[name]], name
        assert [p for _, p, _ in on_gpu[name]] == pytest.approx([p for _, p, _ in on_cpu[name]], abs=1e-5)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    def tokens(seed: int) -> list[int]:
        ROWS["seeded"] = {"sampling": SamplingConfig(temperature=3.0, seed=seed)}
        try:
            return [t for t, _, _ in run(["seeded", "greedy", "top-p"])["seeded"]]
        finally:
            del ROWS["seeded"]

    assert tokens(7) == tokens(7) and tokens(2**64 - 1) == tokens(2**64 - 1)
    assert len({tuple(tokens(seed)) for seed in (7, 8, 9, 2**63, 2**64 - 1)}) == 5


def processed_reference(name: str, history: list[int], step: int) -> torch.Tensor:
    """The row's logits processed by hand, TensorRT-LLM's order: bias, penalties, bans."""
    req, logits = request(name), step_logits(step, 1)[0, :VOCAB].clone()
    if req.embedding_bias is not None:
        logits += req.embedding_bias[:VOCAB]
    s = req.sampling
    if s.penalised:
        scale = s.temperature if s.temperature > 0 else 1.0
        logits = penalised(logits[None], id_counts(history, VOCAB)[None], torch.tensor([s.repetition_penalty]),
                           torch.tensor([s.presence_penalty * scale]), torch.tensor([s.frequency_penalty * scale]))[0]
    banned = BadWords(req.bad_words).banned(history)
    if step < s.min_tokens:
        banned += held_until_min_tokens(END, [[STOP]])
    logits[banned] = float("-inf")
    return logits


@pytest.mark.parametrize("name", [name for name in ROWS if not request(name).sampling.temperature])
def test_greedy_rows_take_the_argmax_of_their_processed_logits(name):
    history = list(PROMPT)
    for step, (token, log_prob, error) in enumerate(run(list(ROWS))[name]):
        expected = processed_reference(name, history, step)
        assert error is None and token == int(expected.argmax())
        if request(name).output.return_log_probs:
            assert log_prob == pytest.approx(float(torch.log_softmax(expected, dim=-1)[token]), abs=1e-5)
        else:
            assert log_prob == 0.0
        history.append(token)
    if name == "min tokens":
        assert [t for t, _, _ in run([name])[name]][:3] != [END] * 3 and run(["greedy"])["greedy"][0][0] == END


def test_sampled_rows_keep_to_their_top_k_and_top_p_and_give_their_log_probs():
    chosen = run(list(ROWS))
    for name in ("top-k", "top-p", "top-k and top-p", "log-probs, sampled"):
        s, history = request(name).sampling, list(PROMPT)
        for step, (token, log_prob, _) in enumerate(chosen[name]):
            probs = torch.softmax(processed_reference(name, history, step) / s.temperature, dim=-1)
            if request(name).output.return_log_probs:  # the distribution before top-k and top-p
                assert log_prob == pytest.approx(math.log(float(probs[token])), abs=1e-5)
            kept = probs
            if s.top_k:
                kept = torch.where(probs >= probs.sort(descending=True).values[s.top_k - 1], probs, 0.0)
                kept = kept / kept.sum()
                assert int((kept > kept[token]).sum()) < s.top_k, (name, step)
            if s.top_p < 1:
                assert float(kept[kept > kept[token]].sum()) < s.top_p, (name, step)
            history.append(token)


def test_a_row_left_nothing_to_choose_fails_alone():
    ROWS["all banned"] = {"embedding_bias": torch.full((VOCAB,), float("-inf"))}
    ROWS["nan bias"] = {"embedding_bias": torch.tensor([float("nan")])}
    try:
        chosen = run(["greedy", "all banned", "sampled", "nan bias"])
    finally:
        del ROWS["all banned"], ROWS["nan bias"]
    assert chosen["all banned"][0][2].startswith("every token is excluded")
    assert chosen["nan bias"][0][2].startswith("the logits hold NaN")
    assert chosen["greedy"] == run(["greedy"])["greedy"] and chosen["sampled"] == run(["sampled"])["sampled"]


def test_a_slot_admitted_again_forgets_the_request_before():
    chooser = TokenChooser(2, VOCAB)
    chooser.admit(0, request("biased"), list(PROMPT))
    chooser.admit(1, request("greedy"), list(PROMPT))
    chooser.choose([0, 1], step_logits(0, 2))
    chooser.release(0)
    chooser.admit(0, request("greedy"), list(PROMPT))
    tokens, _, _ = chooser.choose([0, 1], step_logits(0, 2))
    assert tokens[0] == tokens[1] == int(step_logits(0, 1)[0, :VOCAB].argmax())


# --- the noise -------------------------------------------------------------------------------------------


def test_the_gumbel_max_draw_samples_the_distribution():
    """20,000 draws (seeds × draw counts) from softmax(scores): each id's frequency within 4.5 standard errors."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    scores = torch.log(probs).expand(20_000, -1)
    seeds = torch.arange(20_000) // 10 * 7919
    drawn = torch.arange(20_000) % 10
    counts = torch.bincount(gumbel.gumbel_argmax(scores, seeds, drawn), minlength=6).float()
    error = (probs * (1 - probs) / 20_000).sqrt()
    assert ((counts / 20_000 - probs).abs() < 4.5 * error).all(), counts / 20_000


def test_the_noise_is_uniform_and_depends_on_seed_count_and_id():
    cols = torch.arange(4096)
    u = torch.exp(-torch.exp(-gumbel.gumbel_noise(torch.tensor([3]), torch.tensor([0]), cols)[0].double()))
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.05  # neighbouring ids
    rows = gumbel.gumbel_noise(torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0]), cols)
    assert not torch.equal(rows[0], rows[1]) and not torch.equal(rows[0], rows[2])


def gpu_kernel_device() -> str | None:
    """Where the Triton kernel runs: the GPU, or Triton's interpreter on the CPU; None without Triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


@pytest.mark.skipif(gpu_kernel_device() is None, reason="needs Triton on a GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("sorted_ids", [False, True])
def test_the_gpu_kernel_draws_what_the_torch_ops_draw(sorted_ids):
    from trtglm.runtime.fast.sampling_kernel import gumbel_argmax_kernel

    device, rows, width = gpu_kernel_device(), 6, 9000  # more than one block of ids
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(rows, width, generator=generator).to(device)
    seeds = torch.tensor([0, 1, 2**63 - 1, -5, -2**63, 123456789012345], device=device)
    drawn = torch.tensor([0, 3, 7, 100, 2**33 + 1, 5], device=device)
    cols = torch.stack([torch.randperm(width, generator=generator) for _ in range(rows)]).to(device) \
        if sorted_ids else None
    out = torch.empty(rows, dtype=torch.int64, device=device)
    gumbel_argmax_kernel[(rows,)](scores, scores.stride(0), cols if sorted_ids else scores,
                                  cols.stride(0) if sorted_ids else 0, seeds, drawn, out, width,
                                  HAS_COLS=sorted_ids, BLOCK=gumbel.BLOCK)
    ids = cols if sorted_ids else torch.arange(width, device=device)
    best = (scores + gumbel.gumbel_noise(seeds, drawn, ids)).argmax(dim=-1)
    expected = cols.gather(1, best[:, None])[:, 0] if sorted_ids else best
    assert out.tolist() == expected.tolist()
