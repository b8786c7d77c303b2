#!/usr/bin/env bash
# A commlab sweep on one machine where every configuration runs under torchrun (as on a
# cluster) instead of commlab's spawned ranks; the results are the same format.
#
#   scripts/torchrun_sweep.sh sweeps/smoke.yaml [commlab sweep options]
set -euo pipefail
SPEC=${1:?usage: scripts/torchrun_sweep.sh SPEC.yaml [commlab sweep options]}
shift
exec commlab sweep "$SPEC" --launcher torchrun "$@"
