"""The ``lightning-parallel`` command: Lightning's ``LightningCLI`` for the demo GPT, with our strategy names.

``lightning-parallel fit --trainer.strategy=zero2 --trainer.devices=2`` (or ``python -m lightning_parallel ...``)
trains :class:`~lightning_parallel.demos.GPTLightningModule` on :class:`~lightning_parallel.demos.TextDataModule`
(``--data=RandomTokenDataModule`` picks seeded random tokens instead). ``--trainer.strategy`` takes a registry name
(``data_parallel``, ``zero1``/``zero2``/``zero3``, ``pipeline``, ...) or a class path with ``init_args``;
``--print_config=comments`` writes a YAML file whose comments are our docstrings. ``lightning-parallel plan ...``
runs the memory/layout planner (:mod:`lightning_parallel.planner`) instead of Lightning.

In your own program, ``import lightning_parallel`` before constructing ``LightningCLI`` so the registry names exist.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import Strategy, StrategyRegistry

import lightning_parallel  # noqa: F401  (registers our strategy names with Lightning)
from lightning_parallel.strategies.registry import STRATEGY_CLASSES, registered_names

__all__ = ["DEFAULT_DATAMODULE", "ParallelCLI", "main", "run_cli", "unknown_strategy_message"]

DEFAULT_DATAMODULE = "lightning_parallel.demos.data.TextDataModule"
"""Data module used when ``--data`` is not given: the embedded text corpus (no download). The demo is imported by
:func:`run_cli` only, so importing this module (or ``lightning-parallel plan``) does not load it."""


_DESCRIPTION = (
    "Train, validate, test or predict with the demo GPT (lightning_parallel.demos) under any strategy:"
    " --trainer.strategy=zero2 (a registry name) or a class path with init_args. `lightning-parallel plan --help`:"
    " the memory/layout planner. Docs: docs/cli.md."
)


def unknown_strategy_message(name: str) -> str | None:
    """``None`` if ``name`` is a strategy name Lightning accepts, else an error message listing the valid names."""
    if name.lower() == "auto" or name.lower() in StrategyRegistry:
        return None
    ours = registered_names()
    others = sorted(set(StrategyRegistry.available_strategies()) - set(ours))
    return (
        f"Unknown strategy name `--trainer.strategy={name}`. lightning_parallel's names: {', '.join(ours)}."
        f" Lightning's own: auto, {', '.join(others)}. Or give a class path with init_args, e.g."
        " `--trainer.strategy=lightning_parallel.ShardedOptimizerStrategy --trainer.strategy.stage=2`."
    )


class ParallelCLI(LightningCLI):
    """``LightningCLI`` taking bare strategy class paths too, and listing the valid names for an unknown one."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Default ``--data`` to the text corpus; any ``LightningDataModule`` class path is accepted."""
        parser.set_defaults({"data": {"class_path": DEFAULT_DATAMODULE}})

    def before_instantiate_classes(self) -> None:
        """Resolve a bare strategy class path; reject an unknown strategy name before any process starts."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = config.get("trainer", {}).get("strategy")
        if not isinstance(strategy, str):
            return
        strategy_class = _strategy_class(strategy)
        if strategy_class is not None:
            # `Trainer(strategy: str | Strategy)`: jsonargparse keeps a class path without init_args as a string.
            class_path = f"{strategy_class.__module__}.{strategy_class.__qualname__}"
            config.trainer.strategy = Namespace(class_path=class_path, init_args=Namespace())
            return
        message = unknown_strategy_message(strategy)
        if message is not None:
            self.parser.error(message)


def _strategy_class(name: str) -> type[Strategy] | None:
    """The ``Strategy`` subclass that ``name`` (``pkg.module.Class``, or one of our class names) imports, if any."""
    if name in StrategyRegistry:
        return None
    ours = {cls.__name__: cls for cls in STRATEGY_CLASSES}
    if name in ours:
        return ours[name]
    module_name, _, class_name = name.rpartition(".")
    if not module_name:
        return None
    try:
        candidate = getattr(importlib.import_module(module_name), class_name, None)
    except ImportError:
        return None
    return candidate if isinstance(candidate, type) and issubclass(candidate, Strategy) else None


def _run_planner(args: list[str]) -> int:
    try:
        planner = importlib.import_module("lightning_parallel.planner")
    except ModuleNotFoundError as error:
        if error.name != "lightning_parallel.planner":
            raise  # the planner exists but one of its own imports is missing: show that
        print(
            "`lightning-parallel plan` needs lightning_parallel.planner, which this installation does not have.",
            file=sys.stderr,
        )
        return 2
    return int(planner.main(args))


def run_cli(args: Sequence[str] | None = None, **cli_kwargs: Any) -> ParallelCLI:
    """Build and (unless ``run=False`` is passed) run the CLI of the demo GPT; return the ``LightningCLI`` object.

    Args:
        args: Command-line arguments after the program name; ``None`` reads ``sys.argv``.
        cli_kwargs: Overrides of the ``LightningCLI`` keyword arguments (``run``, ``save_config_kwargs``, ...).
    """
    kwargs: dict[str, Any] = {
        "subclass_mode_data": True,
        "parser_kwargs": {"prog": "lightning-parallel", "description": _DESCRIPTION},
        "save_config_kwargs": {"overwrite": True},
        # GPTLightningModule's own configure_optimizers builds the optimizer: no --optimizer/--lr_scheduler options.
        "auto_configure_optimizers": False,
    }
    kwargs.update(cli_kwargs)
    from lightning_parallel.demos import GPTLightningModule  # the command's model: loaded when the command runs

    # None: LightningCLI reads sys.argv itself (it warns when given a list while sys.argv holds arguments too).
    return ParallelCLI(GPTLightningModule, LightningDataModule, args=None if args is None else list(args), **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lightning-parallel`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit code.

    ``plan`` goes to :func:`lightning_parallel.planner.main`; every other subcommand (``fit``, ``validate``,
    ``test``, ``predict``) to ``LightningCLI``. With the default ``start_method="popen"`` Lightning starts the other
    processes by re-running ``sys.argv``, so call this from a command line (the console script, ``python -m
    lightning_parallel``), not with an ``argv`` that differs from ``sys.argv[1:]`` (``start_method=fork`` is fine).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "plan":
        return _run_planner(args[1:])
    run_cli(argv)
    return 0
