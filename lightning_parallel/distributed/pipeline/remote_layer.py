"""The placeholder a split leaves where a layer of another pipeline rank was registered in the model."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["RemoteLayer"]

_CONTRACT = (
    "The pipeline contract: a step calls `self(...)` exactly once and computes its loss from the result; the"
    " layers of `pipeline_layers()` run only inside the pipeline."
)


class RemoteLayer(nn.Module):
    """Stands in for a layer that lives on another pipeline rank; calling it explains the contract."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.name = name
        self.stage = stage
        self.orphaned = False
        """Set when the run failed before the whole model could be put back: any access then raises."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.orphaned:
            raise self._orphaned_error()
        raise RuntimeError(
            f"`{self.name}` lives on pipeline stage {self.stage}, not on this rank, so it cannot be called here."
            f" {_CONTRACT} Call `self(...)` in the step instead of reaching into submodules."
        )

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.orphaned:
            raise self._orphaned_error()
        return super().state_dict(*args, **kwargs)

    def _orphaned_error(self) -> RuntimeError:
        return RuntimeError(
            f"`{self.name}` lived on pipeline stage {self.stage} of a pipeline run that failed, so this module holds"
            " only this rank's stages and cannot give its whole state. Load the last checkpoint into a fresh module"
            " (`LitModel.load_from_checkpoint(path)`)."
        )

    def extra_repr(self) -> str:
        return f"name={self.name!r}, stage={self.stage}"
