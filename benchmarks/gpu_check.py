"""The GPU check (``make gpu-check``): what CPU cannot find, on NCCL, against one device, on one borrowed GPU.

Usage, from the repository root, with the machine's own python and packages (nothing installed, no network)::

    PYTHONPATH=. python3 -m benchmarks.gpu_check --out DIR --budget-s 480          # a machine with a CUDA GPU
    PYTHONPATH=. python3 -m benchmarks.gpu_check --device cpu --out DIR --budget-s 300  # the CPU stand-in (gloo)

The rows (``benchmarks/gpu_check_plan.py``) run most telling first. Before each, its cost is estimated from the fits
timed so far; a row that would not finish inside what is left of ``--budget-s`` is reported as skipped, not failed.
A row still running ``GRACE_S`` after the budget ends the check (the table so far is written, the row marked). Each
row writes its checkpoints into a folder under ``DIR`` that is deleted when the row ends, failed or not; the check
prints the most bytes held at once and written in all. It prints the table and leaves exactly two files in ``DIR``:
``gpu_check.md`` and ``gpu_check.json`` (``--results`` also writes the section into a RESULTS.md).

Without CUDA (and without ``--device cpu``) it stops at once with exit status 2 and says why; it exits 1 if a row
failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from benchmarks.gpu_check_fit import CheckSettings, Fitted, compare, configure_device, fit, resume, tolerance
from benchmarks.gpu_check_plan import FORK, STALE, TORCHFT, Row, fit_plan, plan, reference_plan
from benchmarks.gpu_check_report import DiskUse, Outcome, render_markdown, write_tables
from benchmarks.harness import one_line
from benchmarks.report import mib, update_section
from lightning_parallel.demos import GPTLightningModule, RandomTokenDataset
from lightning_parallel.demos.main import quiet_lightning

__all__ = ["NAME", "NO_CUDA_MESSAGE", "Check", "check_fork_refusal", "main"]

NAME = "gpu_check"
"""Section name in RESULTS.md."""

NO_CUDA_MESSAGE = (
    "The GPU check needs a CUDA GPU: torch.cuda.is_available() is False (torch {version}, CUDA build: {cuda}). Run it"
    " on a machine with a CUDA GPU: `PYTHONPATH=. python3 -m benchmarks.gpu_check --out DIR --budget-s 480`; or run"
    " its CPU stand-in: `PYTHONPATH=. python3 -m benchmarks.gpu_check --device cpu --out DIR`."
)
WORK_DIR = ".gpu_check_work"
"""The folder under ``--out`` that holds the running row's files; removed after each row and at the end."""
GRACE_S = 30.0
"""How long past ``--budget-s`` a running row may go on before the check stops: with ~15 s of imports before the
budget starts, 480 + 30 s stays inside a 10-minute device command."""
RESERVE_S = 5.0
"""Kept back from the budget for writing the table."""
FIRST_FIT_S = {"cuda": 20.0, "cpu": 4.0}
"""The estimate of one fit before any was timed (the first includes CUDA's and Lightning's start-up)."""
RESUME_FITS, FORK_FITS, WORKER_START_FITS = 0.75, 0.3, 2.0
"""Costs in fits: a resume (half the steps, the load), the fork refusal, the start-up of a torchft group process."""


def check_fork_refusal() -> str:
    """With CUDA initialised in this process, a fork (``*_notebook``) strategy must refuse to start ``fit``."""
    if not torch.cuda.is_initialized():
        return "skipped: CUDA is not initialised in this process"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="data_parallel_notebook", max_steps=1, logger=False)
    try:
        trainer.fit(GPTLightningModule("tiny"), DataLoader(RandomTokenDataset(4, 16), batch_size=2))
    except RuntimeError as error:
        if "CUDA was initialised in this process" in str(error):
            return "ok (RuntimeError before forking)"
        return f"FAILED: another RuntimeError: {one_line(error)}"
    return "FAILED: the fork strategy started although CUDA was initialised"


def _tree_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file()) if directory.exists() else 0


class Check:
    """Runs the rows inside a budget, one folder of files per row, deleted when the row ends."""

    def __init__(self, settings: CheckSettings, out: Path, *, budget_s: float, device: str) -> None:
        self.settings, self.out, self.device = settings, out, device
        self.budget_s = budget_s
        self.work = out / WORK_DIR
        self.started = time.monotonic()
        self.references: dict[str, Fitted] = {}
        self.fit_seconds: list[float] = []
        self.disk = DiskUse()
        self.outcomes: list[Outcome] = []
        self.running: Row | None = None

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def fit_s(self) -> float:
        """The estimate of one fit: the mean of those timed after the first (which includes the start-up)."""
        if not self.fit_seconds:
            return FIRST_FIT_S[self.settings.device]
        return statistics.fmean(self.fit_seconds[1:] or self.fit_seconds)

    def estimate_s(self, row: Row) -> float:
        """Seconds ``row`` is expected to take: its fits (and its reference's, if not fitted yet), in fits timed."""
        if row.name == FORK:
            return FORK_FITS * self.fit_s()
        fits = 1.0 + (RESUME_FITS if row.resumes else 0.0)
        fits += 1.0 if row.reference_key not in self.references else 0.0
        fits += WORKER_START_FITS if row.name == TORCHFT else 0.0
        return fits * self.fit_s() * (2 if row.world_size > 1 else 1)  # spawned ranks start Python and CUDA

    def run(self, rows: Sequence[Row]) -> list[Outcome]:
        """Every row in order; the table is rewritten after each (a stopped check leaves what it had)."""
        try:
            for row in rows:
                print(f"{row.name} x{row.world_size} {row.precision} ...", end=" ", flush=True)
                outcome = self.run_row(row)
                print(f"{outcome.result} ({outcome.seconds:.1f} s)", flush=True)
                self.outcomes.append(outcome)
                self.write()
        finally:
            shutil.rmtree(self.work, ignore_errors=True)
        return self.outcomes

    def run_row(self, row: Row) -> Outcome:
        """One row: skipped (with the reason), or measured with its files deleted after, whatever happens."""
        if row.skip is not None:
            return Outcome(row, f"skipped: {row.skip}")
        need, left = self.estimate_s(row), self.left_s() - RESERVE_S
        if need > left:
            return Outcome(row, f"skipped: budget (estimated {need:.0f} s, {max(left, 0):.0f} s left)")
        directory = self.work / f"row{len(self.outcomes)}"
        self.running, start = row, time.monotonic()
        try:
            outcome = self._measure(row, directory)
        except Exception as error:  # one failing row must not hide the others
            outcome = Outcome(row, f"FAILED: {one_line(error)}")
        finally:
            size = _tree_bytes(directory)
            shutil.rmtree(directory, ignore_errors=True)
            self.running = None
        outcome.seconds, outcome.disk_bytes = time.monotonic() - start, size
        self.disk.add(row, size)
        return outcome

    def _reference(self, key: str, directory: Path) -> Fitted:
        """The one-device run ``key`` (fitted once, then kept)."""
        if key not in self.references:
            try:
                self.references[key] = fit(self.settings, reference_plan(key), directory)
            except Exception as error:
                raise RuntimeError(f"the one-device reference `{key}` failed: {one_line(error)}") from None
            self.fit_seconds.append(self.references[key].seconds)
        return self.references[key]

    def _measure(self, row: Row, directory: Path) -> Outcome:
        if row.name == FORK:
            return Outcome(row, check_fork_refusal())
        assert row.reference_key is not None
        reference = self._reference(row.reference_key, directory / "reference")
        if row.name == TORCHFT:
            from benchmarks.gpu_check_torchft import fit_replica_groups

            timeout = self.left_s() + GRACE_S / 2
            fitted = fit_replica_groups(self.settings, row.precision, directory / "torchft", timeout=timeout)
            loss, weight = compare(fitted, reference, tolerance(row.precision, world_size=2))
            return Outcome(row, loss_diff=loss, weight_diff=weight, peaks=fitted.peaks)
        fitted = fit(self.settings, fit_plan(row), directory / "fit")
        self.fit_seconds.append(fitted.seconds)
        tol = tolerance(row.precision, world_size=row.world_size)
        try:
            loss, weight = compare(fitted, reference, tol)
        except AssertionError:
            if row.name != STALE:
                raise
            return Outcome(row, "ok (rejected, as it must be)", loss_diff=_loss_diff(fitted, reference))
        if row.name == STALE:
            return Outcome(row, "FAILED: the comparison did not catch a one-step-stale weight (tolerance too wide)")
        outcome = Outcome(row, loss_diff=loss, weight_diff=weight, peaks=fitted.peaks)
        if row.resumes:
            resumed = resume(self.settings, fit_plan(row), directory / "fit" / "mid.ckpt", directory / "resumed")
            outcome.peaks["load"] = resumed.peaks["load"]
            outcome.resume_diff = compare(resumed, fitted, tol)[1]
        return outcome

    def summary(self) -> str:
        ran = [o for o in self.outcomes if not o.result.startswith("skipped")]
        failed = sum(o.failed for o in self.outcomes)
        return (
            f"{len(ran)} of {len(self.outcomes)} rows ran, {failed} failed, in"
            f" {time.monotonic() - self.started:.0f} s of a {self.budget_s:.0f} s budget. Disk: at most"
            f" {mib(self.disk.peak_bytes, 1)} MiB held at once ({self.disk.peak_row}),"
            f" {mib(self.disk.written_bytes, 1)} MiB written in all, all deleted."
        )

    def write(self, *, running: str | None = None) -> str:
        """Write the table (and ``running``: a row cut off) into ``out``; return its Markdown."""
        outcomes = list(self.outcomes)
        if running is not None and self.running is not None:
            outcomes.append(Outcome(self.running, running))
        markdown = render_markdown(outcomes, settings=self.settings, device=self.device, summary=self.summary())
        meta = {"device": self.device, "settings": asdict(self.settings), "budget_s": self.budget_s}
        meta |= {"elapsed_s": time.monotonic() - self.started, "disk": asdict(self.disk)}
        write_tables(self.out, outcomes, markdown=markdown, meta=meta)
        return markdown


def _loss_diff(ours: Fitted, reference: Fitted) -> float:
    return float((torch.tensor(ours.losses) - torch.tensor(reference.losses)).abs().max())


def _stop_when_overdue(check: Check) -> threading.Timer:
    """A timer that ends the process ``GRACE_S`` after the budget: a hung collective must not eat the lease."""

    def stop() -> None:
        markdown = check.write(running=f"FAILED: still running {GRACE_S:.0f} s after the budget; the check stopped")
        shutil.rmtree(check.work, ignore_errors=True)
        print(f"\n{markdown}\nStopped: over budget.", flush=True)
        os._exit(3)

    timer = threading.Timer(max(check.left_s(), 0) + GRACE_S, stop)
    timer.daemon = True
    timer.start()
    return timer


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.md and gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for all rows (default 480)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the stand-in with gloo")
    parser.add_argument("--preset", default=None, help="demo GPT preset (default: gpt-125m on CUDA, tiny on CPU)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per fit, even (default 8)")
    parser.add_argument("--results", type=Path, default=None, help="also write the section into this RESULTS.md")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.steps % 2:
        parser.error(f"--steps={args.steps} must be even and at least 2 (two epochs of --steps / 2).")
    if args.budget_s <= 0:
        parser.error(f"--budget-s={args.budget_s} must be positive.")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; 0 if no row failed, 1 if one did, 2 without CUDA (``--device cuda``), 3 if stopped overdue."""
    args = _parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE.format(version=torch.__version__, cuda=torch.version.cuda), file=sys.stderr)
        return 2
    configure_device(args.device)
    if args.device == "cuda":
        torch.cuda.init()  # the fork refusal's premise, whatever rows run before it
    settings = CheckSettings.for_device(args.device, preset=args.preset, steps=args.steps)
    quiet_lightning()
    logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*no `val_dataloader`.*")  # the demo module has a validation_step
    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    device = f"{torch.cuda.get_device_name(0)} x{num_gpus}" if num_gpus else "CPU (stand-in, gloo)"
    device += f", torch {torch.__version__}, lightning {pl.__version__}"
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(settings, args.out, budget_s=args.budget_s, device=device)
    # `timeout` and job schedulers send SIGTERM: unwind (the running row's `finally` deletes its files) and exit.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    timer = _stop_when_overdue(check)
    outcomes = check.run(plan(args.device, num_gpus=num_gpus))
    timer.cancel()
    markdown = check.write()
    print(f"\n{markdown}\nWritten to {args.out}.")
    if args.results is not None:
        update_section(NAME, markdown, path=args.results)
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
