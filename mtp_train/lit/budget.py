"""Training to a time budget (train.time_budget_min, or a pipeline deadline: budget.deadline).

The honest control of "how long may training take" on machines whose steps differ 3x in cost is
wall time, but a learning-rate schedule cut off by a timer ends at full learning rate. So this
callback plans the number of optimizer steps from the time steps and validations actually take,
and sets the schedule's length (`LrShape.total`) to it: the schedule runs over the budget.

- The first `skip` steps of a process are not timed (allocation, first-touch); after `measure`
  timed steps the first plan is made, then it is revised every `revise` steps and after every
  validation from the mean of the last WINDOW steps, so the plan follows a machine that speeds up
  or slows down.
- planned = step + (seconds left - one validation) / (seconds per step + validation / interval):
  the validations Lightning runs every trainer.val_check_interval steps and the one mtp-train runs
  after fitting are inside the budget.
- The plan stays within [min_steps, max_steps]: a floor of steps however slow the machine, and
  trainer.max_steps as a cap. Lightning's own max_time backstops it (`backstop_s`,
  mtp_train/pipeline/training.py) and its min_steps keeps the floor. Where the floor takes longer
  than the budget (a slow machine, a deadline already spent), the backstop is widened to the
  floor's predicted time: left at the budget's, Lightning's Timer signals a stop, and logs it, at
  every step until min_steps lets it. A max_time the user set (trainer.max_time) is never widened.
- Its state (seconds spent, the plan, the measured rates) is saved in checkpoints, so a resumed run
  continues the same budget; `relative=True` (a deadline) gives a resumed run the time that is left
  now on top of what it has spent.
"""

from __future__ import annotations

import logging
import time

from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)


def backstop_s(seconds: float) -> float:
    """Lightning's max_time around a plan of `seconds`: a quarter over it and a minute."""
    return 1.25 * seconds + 60.0


class TimeBudget(Callback):
    WINDOW = 100  # steps of different lengths (train.length_window) average out over this many
    def __init__(self, seconds: float, min_steps: int, max_steps: int, val_interval: int | None = None,
                 measure: int = 8, skip: int = 2, revise: int = 25, relative: bool = False,
                 clock=time.perf_counter, widen_timer: bool = False):
        self.seconds = float(seconds)
        self.min_steps, self.max_steps = int(min_steps), int(max_steps)
        self.val_interval = val_interval if val_interval and val_interval > 0 else None
        self.measure, self.skip, self.revise, self.relative = measure, skip, revise, relative
        self.clock = clock
        self.widen_timer = widen_timer  # Lightning's Timer is the backstop set from this budget, not a user's max_time
        self.spent = 0.0  # seconds of training steps and validations, across resumes
        self.train_s, self.train_steps = 0.0, 0  # timed steps (the first `skip` of a process are not)
        self.recent: list[float] = []  # the last WINDOW timed steps' seconds: the rate plans use
        self.val_s: float | None = None  # the last validation's seconds
        self.val_batches = 0
        self.planned: int | None = None
        self.floor_s: float | None = None  # the floor's predicted seconds, where they exceed the budget
        self.revisions: list[tuple[int, int]] = []  # (at step, planned steps)
        self._mark = self._val_mark = None
        self._seen = 0

    @property
    def state_key(self) -> str:
        return "TimeBudget"

    def state_dict(self) -> dict:
        return {"spent": self.spent, "train_s": self.train_s, "train_steps": self.train_steps,
                "recent": list(self.recent), "val_s": self.val_s, "planned": self.planned,
                "floor_s": self.floor_s, "revisions": [list(r) for r in self.revisions]}

    def load_state_dict(self, state: dict) -> None:
        self.spent = float(state.get("spent", 0.0))
        self.train_s, self.train_steps = float(state.get("train_s", 0.0)), int(state.get("train_steps", 0))
        self.recent = [float(x) for x in state.get("recent", [])]
        self.val_s, self.planned = state.get("val_s"), state.get("planned")
        self.floor_s = state.get("floor_s")
        self.revisions = [tuple(r) for r in state.get("revisions", [])]
        if self.relative:  # a deadline: the time left now comes on top of what was spent before
            self.seconds += self.spent

    # --- hooks -------------------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        self._mark, self._seen = self.clock(), 0
        try:
            self.val_batches = len(trainer.datamodule.val_dataloader()) if trainer.datamodule else 0
        except (TypeError, AttributeError):
            self.val_batches = 0
        if self.planned is not None:  # resumed: the schedule's state already holds it; keep them equal
            self._set(pl_module, self.planned)
        self._widen_timer(trainer)  # resumed past a floor that outlasts the budget: before the Timer's first check

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = self.clock()
        dt, self._mark = now - self._mark, now
        self.spent += dt
        self._seen += 1
        if self._seen > self.skip:
            self.train_s += dt
            self.train_steps += 1
            self.recent = (self.recent + [dt])[-self.WINDOW:]
        step = trainer.global_step
        if self.train_steps >= self.measure and (self.planned is None or step % self.revise == 0):
            self.plan(step)
        elif self.planned is None and self.spent >= self.seconds:  # spent before it could measure
            self.planned = min(self.max_steps, max(self.min_steps, step))
            self.revisions.append((step, self.planned))
            if self.planned > step:  # the floor's time, guessed from the (slowest, first) steps until they are timed
                self.floor_s = self.spent / max(1, self._seen) * self.planned
        self._sync(trainer, pl_module)
        if self.planned is not None and step >= self.planned:
            trainer.should_stop = True

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":  # not trainer.validate() after it
            self._val_mark = self.clock()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val_mark is None or self._mark is None:
            return
        now = self.clock()
        self.val_s = now - self._val_mark
        self.spent += now - self._mark  # the validation and whatever ran between the step and it
        self._mark, self._val_mark = now, None
        if self.train_steps >= self.measure and not trainer.should_stop:  # not after the last step
            self.plan(trainer.global_step)
            self._sync(trainer, pl_module)
            if self.planned <= trainer.global_step:
                trainer.should_stop = True

    # --- the plan ----------------------------------------------------------------------------------

    def step_seconds(self) -> float | None:
        """Seconds a step takes now: the mean of the last WINDOW timed steps."""
        return sum(self.recent) / len(self.recent) if self.recent else None

    def validation_seconds(self) -> float:
        """The last validation's time; before the first, a guess: its batches at 0.4 of a training
        step each (a forward without the backward)."""
        if self.val_s is not None:
            return self.val_s
        return 0.4 * self.val_batches * (self.step_seconds() or 0.0)

    def _sync(self, trainer, pl_module) -> None:
        """Every process trains rank 0's plan (each times its own steps; as Lightning's Timer does,
        rank 0 decides, at the same points on every rank, so that no process stops alone), and the
        schedule runs over it."""
        strategy = getattr(trainer, "strategy", None)
        if strategy is not None and getattr(trainer, "world_size", 1) > 1:
            self.planned = strategy.broadcast(self.planned, 0)
        if self.planned is not None:
            self._set(pl_module, self.planned)
        self._widen_timer(trainer)

    def _widen_timer(self, trainer) -> None:
        """Raise Lightning's Timer (trainer.max_time) to the floor's predicted time where the floor
        outlasts the budget: min_steps overrides its stop anyway, but it would say so every step."""
        if self.floor_s is None or not self.widen_timer:
            return
        from lightning.pytorch.callbacks import Timer

        for cb in getattr(trainer, "callbacks", None) or []:
            # Timer keeps its limit in _duration (seconds) and has no setter for it
            if isinstance(cb, Timer) and cb._duration is not None and cb._duration < backstop_s(self.floor_s):
                log.info("max_time widened from %.1f to %.1f min: train.min_steps=%d takes about %.1f min here",
                         cb._duration / 60, backstop_s(self.floor_s) / 60, self.min_steps, self.floor_s / 60)
                cb._duration = backstop_s(self.floor_s)

    def plan(self, step: int) -> int:
        sps, val = self.step_seconds(), self.validation_seconds()
        left_s = self.seconds - self.spent - val  # the validation after fitting is inside the budget
        log.debug("plan at step %d: %.2f s spent, %.3f s a step, validation %.2f s, %.2f s left", step, self.spent, sps,
                  val, left_s)
        per_step = sps + (val / self.val_interval if self.val_interval else 0.0)
        more = int(left_s / per_step) if left_s > 0 and per_step > 0 else 0
        planned = min(self.max_steps, max(self.min_steps, step + more))
        need = self.spent + max(0, planned - step) * per_step + val
        if planned == self.min_steps and need > self.seconds:
            if self.floor_s is None:
                log.info("time budget %.1f min: the floor of %d steps takes about %.1f min at %.2f s a step; "
                         "training runs the floor", self.seconds / 60, self.min_steps, need / 60, sps)
            self.floor_s = need
        if planned != self.planned:
            self.revisions.append((step, planned))
            if self.planned is None:
                log.info("time budget %.1f min: %.2f s a step, validation %.1f s -> %d steps planned "
                         "(floor %d, cap %d)", self.seconds / 60, sps, val, planned, self.min_steps,
                         self.max_steps)
            self.planned = planned
        return planned

    @staticmethod
    def _set(pl_module, planned: int) -> None:
        shape = getattr(pl_module, "lr_shape", None)
        if shape is not None:
            shape.total = max(1, planned)

    def summary(self, steps: int) -> dict:
        """What the run records (heads.json "budget", the report's line on where the minutes went)."""
        sps = self.step_seconds()
        return {"budget_s": round(self.seconds, 1), "spent_s": round(self.spent, 1), "steps": steps,
                "planned": self.planned, "min_steps": self.min_steps, "max_steps": self.max_steps,
                "step_s": round(sps, 4) if sps else None,
                "validation_s": round(self.val_s, 2) if self.val_s is not None else None,
                "floor_s": round(self.floor_s, 1) if self.floor_s is not None else None,
                "revisions": [list(r) for r in self.revisions]}
