"""Run metadata, re-exported from :mod:`commlab.runtime.metadata` (its home below the apps)."""

from commlab.runtime.metadata import (  # noqa: F401
    command_line,
    cpu_model,
    dirty_warning,
    environment,
    git_state,
    package_versions,
    thread_settings,
)
