"""Integrations with other engines that start the processes for us.

Each integration is a module of its own, imported by name only (``lightning_parallel.integrations.ray``): this
package imports none of them, so ``import lightning_parallel`` never needs, or loads, the other engine.
"""

from __future__ import annotations

__all__: list[str] = []
