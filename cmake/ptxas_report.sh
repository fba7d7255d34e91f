#!/bin/sh
# CUDA compiler launcher of development builds (ROPESCALE_BUILD_TESTS=ON, which compile with -Xptxas=-v):
#   sh ptxas_report.sh REPORT_DIR COMMAND...   (COMMAND: [ccache] nvcc ... -o OBJECT ...)
# runs COMMAND, prints its output as usual and keeps it as REPORT_DIR/<OBJECT's name>.log: the ptxas report of
# the kernels this object ships, which the ptxas_no_spills test reads (ccache replays the report on a hit).
dir=$1
shift
object=
previous=
for arg in "$@"; do
  [ "$previous" = "-o" ] && object=$arg
  previous=$arg
done
mkdir -p "$dir"
log="$dir/$(basename "${object:-unnamed.o}").log"
"$@" >"$log.tmp" 2>&1
status=$?
cat "$log.tmp" >&2
if [ "$status" -eq 0 ]; then mv "$log.tmp" "$log"; else rm -f "$log.tmp" "$log"; fi
exit "$status"
