"""The core's own components, registered as plugins exactly like third-party ones.

Each entry is (plugin name, module with ``@hookimpl`` functions). Any of them can be blocked with
``-p no:NAME``; what it registered then disappears from the run.
"""

BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("miles.platforms", "miles_core.platforms"),
    ("miles.models", "miles_core.models.plugin"),
    ("miles.tasks", "miles_core.data.plugin"),
    ("miles.rewards", "miles_core.rewards.plugin"),
    ("miles.rollout", "miles_core.rollout.plugin"),
    ("miles.algorithms", "miles_core.algorithms.plugin"),
    ("miles.train", "miles_core.train.plugin"),
    ("miles.train.megatron", "miles_core.train.megatron.plugin"),
    ("miles.sync", "miles_core.sync.plugin"),
    ("miles.precision", "miles_core.precision.plugin"),
    ("miles.kernels", "miles_core.kernels.plugin"),
)
