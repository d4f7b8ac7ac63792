"""The tensor declarations and the ensemble's steps of trtglm's template (triton_model_repo/), rendered from the
serving contract (trtglm/backend/contract.py).

Each model's config.pbtxt in the template holds the line MARKER where its declarations go; rendering puts there
one tensor a line, an entry marked with a backend after its block with the comment rendering keeps it by (the
ensemble's steps after its outputs), so that the contract is the one place a tensor is declared.
"""

from __future__ import annotations

from trtglm.backend.contract import CONTRACT, ENSEMBLE, ENSEMBLE_WIRING, Tensor, Wire

MARKER = "# inputs, outputs and ensemble steps: rendered from trtglm/backend/contract.py\n"


def tensor_text(tensor: Tensor) -> str:
    dims = ", ".join(map(str, tensor.dims))
    fields = [f'name: "{tensor.name}"', f"data_type: {tensor.data_type}", f"dims: [ {dims} ]"]
    fields += [text for text, present in (("reshape { shape: [ ] }", tensor.scalar),
                                          ("optional: true", tensor.optional),
                                          ("allow_ragged_batch: true", tensor.ragged)) if present]
    return "{ " + ", ".join(fields) + " }"


def _only_with(item: Tensor | Wire) -> str:
    return f"  # only with backend {item.backend}" if item.backend else ""


def tensors_text(kind: str, tensors: tuple[Tensor, ...]) -> list[str]:
    """The `input`/`output` block of `tensors` (those of every backend), then each backend's own."""
    common = [f"  {tensor_text(t)}" for t in tensors if t.backend is None]
    lines = [f"{kind} [", *(line + "," for line in common[:-1]), *common[-1:], "]"]
    return lines + [f"{kind} {tensor_text(t)}{_only_with(t)}" for t in tensors if t.backend is not None]


def steps_text() -> list[str]:
    """The ensemble's `ensemble_scheduling` block: a step per model, in the order the wiring names them."""
    steps = list(dict.fromkeys(wire.step for wire in ENSEMBLE_WIRING))
    lines = ["ensemble_scheduling {", "  step ["]
    for number, step in enumerate(steps):
        wires = [w for w in ENSEMBLE_WIRING if w.step == step]
        lines += ["    {", f'      model_name: "{step}"', "      model_version: -1"]
        lines += [f'      {"input_map" if w.reads else "output_map"} {{ key: "{w.tensor}", '
                  f'value: "{w.ensemble_tensor}" }}{_only_with(w)}' for w in sorted(wires, key=lambda w: not w.reads)]
        lines.append("    }" + ("," if number < len(steps) - 1 else ""))
    return lines + ["  ]", "}"]


def declarations(model: str) -> str:
    """The part of `model`'s config.pbtxt the contract writes."""
    blocks = [tensors_text("input", CONTRACT[model].inputs), tensors_text("output", CONTRACT[model].outputs)]
    if model == ENSEMBLE:
        blocks.append(steps_text())
    return "\n\n".join("\n".join(block) for block in blocks) + "\n"


def with_declarations(text: str, model: str) -> str:
    """A template config.pbtxt's `text` with its MARKER line replaced by `model`'s declarations (unchanged without
    one: a template that declares its tensors itself, which rendering checks against the contract)."""
    return text.replace(MARKER, declarations(model), 1)
