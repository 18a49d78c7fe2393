"""The lines compare prints of a DSpark drafter's plan and result, either release. Torch-free: the command line
imports it at start-up, and compare/v41.py prints the same lines."""

from __future__ import annotations

from dsv4convert.sizes import human_bytes


def dspark_plan_lines(draft: dict | None, base_d, variant_d) -> list[str]:
    """The plan's DSpark lines, either release: ``draft`` is the estimate's ``dspark`` (``run.py::draft_estimate``,
    None when not compared), ``base_d``/``variant_d`` each side's DSpark config (None without a drafter)."""
    if not draft:
        return ["DSpark drafter: not compared (--no-mtp)"] if base_d is not None else []
    lines = [f"DSpark drafter: {draft['blocks']} blocks of {draft['block_size']} drafts (anchored "
             + ("at every position" if draft["stride"] == 1 else f"every {draft['stride']} positions") + "), "
             f"{draft['stages']} stages per track ({draft['draft_rows']} draft rows each, the variant's "
             f"again on the base's inputs); host memory {human_bytes(draft['host_bytes'])} for target features and "
             f"draft streams, device {human_bytes(draft['device_bytes'])} for a stage and its heads"]
    if tuple(base_d.target_layer_ids) != tuple(variant_d.target_layer_ids):
        lines.append(f"DSpark target layers differ: base {list(base_d.target_layer_ids)}, variant "
                     f"{list(variant_d.target_layer_ids)} (each side drafts from its own; the report measures what "
                     "it costs)")
    return lines


def dspark_result_lines(draft: dict | None) -> list[str]:
    """What a run prints of ``compare.json``'s ``dspark`` (either release): agreement per draft position and the
    expected accepted length per side, then the verdict."""
    if not draft:
        return []
    length = draft["expected_accept_length"]
    return [f"DSpark draft agreement per position ({side}): " + ", ".join(
        f"{100 * p['agreement'][side]:.1f}%" for p in draft["positions"])
        + f"; expected accepted length {length[side]:.3f}" for side in ("base", "variant")] + [
        f"DSpark: {draft['verdict']['sentence']}"]
