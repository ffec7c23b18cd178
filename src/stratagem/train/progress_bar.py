"""`ProgressBar`: a progress bar per epoch on the chief, then one line of metrics per epoch (`format_epoch_line`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from stratagem.train.callback import Callback

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from stratagem.train.fit_state import EpochLog, History, TrainingContext


class ProgressBar(Callback):
    """A progress bar per epoch on the chief (examples, samples/s), then one line of metrics per epoch.

    The library never shows progress on its own: pass ``ProgressBar()`` in `callbacks` (or
    ``fit(verbose=True)``). Workers other than the chief show nothing, so a multi-worker job
    prints one bar, not one per process.

    Args:
        console: where to draw (default: a new ``rich.console.Console()``, standard output).
        show_bar: draw the live bar (default: only when the console is a terminal).
        print_lines: print each epoch's metrics line.
    """

    def __init__(
        self, console: Console | None = None, *, show_bar: bool | None = None, print_lines: bool = True
    ) -> None:
        # rich loads with the first progress bar, not with `import stratagem` (about 0.1 s of CPU).
        from rich.console import Console

        self._console = console or Console(highlight=False, soft_wrap=True)
        self._show_bar = self._console.is_terminal if show_bar is None else show_bar
        self._print_lines = print_lines
        self._progress: Progress | None = None
        self._task: Any = None
        self._started = 0.0
        self._seen = 0
        self._width = 1
        self._epochs = 1

    def on_train_begin(self, context: TrainingContext) -> None:
        self._epochs = context.epochs
        self._width = len(str(context.epochs))

    def on_epoch_begin(self, context: TrainingContext) -> None:
        self._started, self._seen = time.perf_counter(), 0
        if not (context.is_chief and self._show_bar):
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        total = context.examples_per_epoch
        self._progress = Progress(
            TextColumn(f"epoch {context.epoch + 1:>{self._width}}/{self._epochs}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("examples"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=self._console,
            transient=True,
        )
        self._progress.start()
        # After a restore mid-epoch, the examples already trained on count as done.
        self._task = self._progress.add_task("train", total=total, completed=int(context.totals[1]), rate="")

    def on_train_batch_end(self, context: TrainingContext, num_examples: int) -> None:
        self._seen += num_examples
        if self._progress is not None:
            elapsed = time.perf_counter() - self._started
            rate = f"{self._seen / elapsed:,.0f} samples/s" if elapsed > 0 else ""
            self._progress.update(self._task, advance=num_examples, rate=rate)

    def on_epoch_end(self, context: TrainingContext, log: EpochLog) -> None:
        self.close()
        if context.is_chief and self._print_lines:
            from rich.text import Text

            self._console.print(Text(format_epoch_line(log, self._epochs)))

    def on_train_end(self, context: TrainingContext, history: History) -> None:
        self.close()

    def close(self) -> None:
        """Stops the live bar; also called when training fails, so the terminal is left clean."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def format_epoch_line(log: EpochLog, epochs: int) -> str:
    """``epoch 2/10  loss 0.1234  accuracy 96.50%  val_loss ...  (1.2 s, 12,345 samples/s)``."""
    width = len(str(epochs))
    parts = [f"epoch {log.epoch:>{width}}/{epochs}"]
    for name, value in log.metrics.items():
        parts.append(f"{name} {value:6.2%}" if name.endswith("accuracy") else f"{name} {value:.4f}")
    return "  ".join(parts) + f"  ({log.elapsed_s:.1f} s, {log.samples_per_s:,.0f} samples/s)"
