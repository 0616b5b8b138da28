#!/usr/bin/env bash
# matplotlib, pinned, for the plots the benchmarks draw (bench/scaling_plot.py): installed beside
# the torch wheel that scripts/bootstrap.sh unpacks, never into the system's Python.
# Sourced: defines plot_install (idempotent) and plot_env (exports PYTHONPATH).
_plot_here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$_plot_here/scripts/pinned_wheels.sh"
plot_dir="${ZT_DEPS_DIR:-$HOME/.cache/zerotrain}/matplotlib-3.11.2"
# What pip resolves for matplotlib==3.11.2 on Python 3.11, frozen.
plot_wheels=("matplotlib==3.11.2" "contourpy==1.3.3" "cycler==0.12.1" "fonttools==4.68.0" "kiwisolver==1.5.1"
  "numpy==2.4.6" "packaging==26.4" "pillow==13.0.0" "pyparsing==3.3.3" "python-dateutil==4.0.0" "tzdata==2026.6")
plot_install() { pinned_wheels_install "$plot_dir" matplotlib "${plot_wheels[@]}"; }
plot_env() {
  export PYTHONPATH="$plot_dir/site${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONNOUSERSITE=1 MPLBACKEND=Agg MPLCONFIGDIR="$plot_dir/config"
}
