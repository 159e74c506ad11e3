"""The causes the watch names and the fixes it advises, beyond the lesson's general advice in `watch.py`.

Each returns an Event with `cause` (a short name) and `fix` (flags, or "data: ..." / "code: ..." for a change by
hand), chosen from what the step's batch and model show (`Watch.inspect`, mixprec.health.causes), so that the
fix advised is one that can work: no learning rate fixes a NaN in the data, no loss scale a forward overflow.
"""
from __future__ import annotations

import math

from .causes import FP16_MAX, GAIN_LIMIT, INPUT_RMS_LIMIT
from .event import Event, _names

CHANCE_FACTOR = 3.0  # a first loss above this many times chance level (ln classes): logits huge from the start
LR_FLOOR = 1e-6  # a peak AdamW learning rate below this is far too low to train anything in a run's length
LR_MOVES = 1e-3  # AdamW moves a weight by about lr per step: a window whose summed lr is below this cannot learn
COHERENCE_FLOOR = 1.5  # the label probe's gradient ratio (real labels / permuted) below which nothing predicts them
COHERENCE_ROWS = 1024  # fewer training rows are not judged: too few to tell, and a network memorises so few labels
NO_SIGNAL_FIX = "data: check that the labels belong to the inputs"
NO_SIGNAL_WHY = ("This is the data, not the precision or the learning rate: check that the labels belong to the "
                 "inputs (shuffled or unrelated labels have nothing to learn)")


def _lower_lr_fix(watch) -> str:
    """A tenth of the peak rate, and no more than AdamW's usual 1e-3."""
    return f"--lr {min(watch.base_lr / 10, 1e-3):.2g}"


def found(watch, first_step: bool) -> tuple[str, str, str, list[str]] | None:
    """(cause, fix, what was seen, modules) from the step's batch and model, or None when they show nothing.
    A layer's gain is judged before any step is applied only (later, the training made the weights)."""
    seen = watch.inspect() or {}
    if seen.get("nonfinite_inputs"):
        rows = sorted(set(seen["nonfinite_rows"]))
        return ("nonfinite_data", "data: remove or repair the rows with NaN/inf features",
                f"this step's batch holds {seen['nonfinite_inputs']} NaN/inf input value(s), in {len(rows)} of its rows "
                f"(rows {', '.join(map(str, rows[:5]))} of the batch): the data, not the training, so no learning "
                f"rate, clipping or precision fixes it. Remove or repair those rows (without --allow_nonfinite_data "
                f"the run refuses such a file and names the row and column)", [])
    if seen.get("outlier_rows"):
        rows = seen["outlier_rows"]
        return ("outlier_data", "data: remove or repair the rows whose features are far outside the others' scale",
                f"this step's batch holds {len(rows)} row(s) whose inputs are up to {seen['outlier_factor']:.0f}x the "
                f"scale of its typical row (rows {', '.join(map(str, rows[:5]))} of the step's micro-batches, counted "
                f"in order): a bad row in the data, not the learning rate or the precision. Remove or repair those "
                f"rows (look for a unit or a sentinel value such as 9999 in one column)", [])
    rms = seen.get("input_rms")
    if rms is not None and rms > INPUT_RMS_LIMIT:
        return ("input_scale", "data: standardise the input features (zero mean, unit variance per column)",
                f"the inputs' root mean square is {rms:.3g}, far above the unit scale layers are initialised for "
                f"(above {INPUT_RMS_LIMIT:g}): standardise the features (subtract each column's mean, divide by its "
                f"standard deviation)", [])
    if seen.get("overflow"):
        mods = seen["overflow"]
        return ("fp16_forward_overflow", f"--fp32_modules {','.join(mods)}",
                f"in fp16 the activations of {_names(mods)} exceed {FP16_MAX:g} (measured in fp32 on this batch) and "
                f"become inf in the forward pass: no loss scale fixes a forward overflow (the GradScaler scales only "
                f"the backward). Keep those layers in fp32: --fp32_modules {','.join(mods)} (or switch to bf16: "
                f"--mixed_precision bf16)", list(mods))
    gain = seen.get("gain")
    if first_step and gain and gain[1] > GAIN_LIMIT:
        return ("layer_init", f"code: re-initialise {gain[0]}",
                f"{gain[0]}'s output is {gain[1]:.3g}x its input's root mean square before any step was applied "
                f"(a weight layer's is about 1): it is initialised to explode. Re-initialise {gain[0]} (e.g. torch's "
                f"default or a std of 1/sqrt(fan_in)); no learning rate or precision fixes its first steps",
                [gain[0]])
    return None


def at_start(watch, step: int, loss: float, chance: float) -> Event:
    what = (f"the first loss {loss:.4g} is {loss / chance:.0f}x chance level (ln {watch.classes} = {chance:.3g}): the "
            f"logits are huge before training has done anything")
    cause = found(watch, True)
    if cause is None:
        cause = ("logits_at_start", "code: check the model's initialisation and the inputs' scale",
                 "check the model's initialisation and the inputs' scale", [])
    return Event(step, "loss_at_start", loss, CHANCE_FACTOR * chance, f"{what}. {cause[2]}.", cause[3],
                 cause[0], cause[1])


def diverging(watch, step: int, loss: float) -> Event:
    cause = found(watch, False)
    if cause is not None and cause[0] in ("outlier_data", "input_scale"):  # the batch's rows, not the step size
        text = f"the loss rose to {loss:.4g}, over twice its first value {watch.first_loss:.4g}. Cause: {cause[2]}"
        return Event(step, "loss_diverging", loss, 2 * watch.first_loss, text + ".", [], cause[0], cause[1])
    fix = _lower_lr_fix(watch)
    text = (f"the loss rose to {loss:.4g}, over twice its first value {watch.first_loss:.4g}: training is diverging. "
            f"The learning rate is too high (now {watch.lr:.3g}, peak --lr {watch.base_lr:g}): {fix}")
    return Event(step, "loss_diverging", loss, 2 * watch.first_loss, text + ".", [], "lr_too_high", fix)


def underflow(watch, step: int, loss: float) -> Event:
    scale = (watch.inspect() or {}).get("scale", watch.scale)
    now = f" at loss scale {scale:g}" if scale is not None else ""
    target = max(65536.0, 2 * (scale or 0))
    fix = f"--init_scale {target:g}"
    text = (f"fp16: every gradient is zero{now} while the loss is {loss:.4g}: the scaled gradients are below "
            f"fp16's smallest subnormal (6e-08) and flush to zero, so nothing learns. Raise the loss scale: {fix} "
            f"(or switch to bf16: --mixed_precision bf16)")
    return Event(step, "grad_underflow", 0.0, None, text + ".", [], "fp16_grad_underflow", fix)


def fp16_overflow(watch, step: int, scale: float | None, modules: list[str]) -> Event | None:
    """fp16 steps skipped with a finite loss: do the gradients overflow even at loss scale 1 (no scale fits: the
    scale collapses), or would a lower initial scale fit them? None when neither is known."""
    unscaled = (watch.inspect(unscaled=True) or {}).get("unscaled")
    if not unscaled:
        return None
    steps = f"the GradScaler skipped {watch.streak} steps in a row" + (f" (scale now {scale:g})" if scale else "")
    if unscaled["modules"]:
        mods = unscaled["modules"]
        text = (f"{steps}, and this step's gradients overflow fp16 ({FP16_MAX:g}) even at loss scale 1, in "
                f"{_names(mods)} (it starts in {mods[-1]}, the latest in the forward pass): no loss scale fits, so "
                f"the scale collapses. fp16's range is too small for this model: switch to bf16 (--mixed_precision "
                f"bf16), which has fp32's range, or keep {mods[-1]} in fp32 (--fp32_modules)")
        watch.cause = ("loss_scale_collapse", "--mixed_precision bf16", text, mods)
        return Event(step, "skipped_steps", watch.streak, None, text + ".", mods, *watch.cause[:2])
    if watch.steps_taken == 0 and unscaled["largest"] > 0:
        fits = 2.0 ** math.floor(math.log2(FP16_MAX / unscaled["largest"]) - 3)  # room for intermediate values
        fix = f"--init_scale {fits:g}"
        text = (f"{steps} and none has been applied: the largest gradient at loss scale 1 is "
                f"{unscaled['largest']:.3g}, so --init_scale {watch.init_scale:g} overflows fp16. Start from a "
                f"scale that fits: {fix}")
        return Event(step, "skipped_steps", watch.streak, None, text + ".", list(modules), "init_scale_too_high", fix)
    return None


def lr_far_too_low(watch, step: int) -> Event:
    fix = "--lr 0.001"
    text = (f"the peak learning rate --lr {watch.base_lr:g} is below {LR_FLOOR:g}: AdamW moves each weight by about "
            f"the learning rate per step, so a million steps would move it by less than 1. Raise it into AdamW's "
            f"usual 1e-4 to 3e-3, e.g. {fix}")
    return Event(step, "lr_too_low", watch.base_lr, LR_FLOOR, text + ".", [], "lr_too_low", fix)


def stall(watch, after: float) -> tuple[str, str, str]:
    """(cause, fix, text) of a stalled loss: the learning rate too small to move the weights, or a loss at chance
    level while they move (nothing to learn), or unknown."""
    moved = sum(watch.lrs)
    chance = math.log(watch.classes) if watch.classes and watch.classes > 1 else None
    if moved < LR_MOVES:
        fix = "--lr 0.001"
        return ("lr_too_low", fix, f"AdamW moves each weight by about the learning rate per step: over the last "
                f"{len(watch.lrs)} steps that is at most {moved:.2g} in all, too little to change anything. The "
                f"learning rate (now {watch.lr:.3g}) is far too low: raise it into AdamW's usual 1e-4 to 3e-3, e.g. {fix}")
    if chance and abs(after - chance) < 0.05 * chance:
        return ("no_signal", NO_SIGNAL_FIX,
                f"the loss stays at chance level (ln {watch.classes} = {chance:.3g}) while the weights move (the "
                f"learning rates of the window sum to {moved:.2g}): the model finds nothing in the inputs that "
                f"predicts the labels. {NO_SIGNAL_WHY}")
    return ("", "", "")


def labels_unrelated(watch, step: int, ratio: float, rows: int) -> Event:
    """The label probe (mixprec.health.coherence): the labels do not steer the gradients."""
    text = (f"on {rows} training rows, the part of the loss's gradient that depends on the labels is {ratio:.2f}x as "
            f"large with the rows' labels as with the same labels shuffled among them (below {COHERENCE_FLOOR:g}x): "
            f"the examples' gradients do not agree: nothing the model computes from the inputs yet predicts the "
            f"labels. {NO_SIGNAL_WHY}. Labels that depend on the inputs only "
            f"through a combination the untrained model has not formed (an XOR of two features) look the same at "
            f"first and can still be learned: if the labels are right, pass --label_probe_samples 0")
    return Event(step, "labels_unrelated", ratio, COHERENCE_FLOOR, text + ".", [], "no_signal", NO_SIGNAL_FIX)
