# ctest driver for ptxas_check_detects_spills: compiles SOURCE (a kernel that must spill) with `nvcc -Xptxas -v`
# for each arch in ARCHS, writes the ptxas report to LOG and runs the spill check over it (scripts/ptxas_summary.py,
# the check ptxas_no_spills runs over the library's reports), which must report the spill.
#   cmake [-DCCACHE=ccache] -DNVCC=... -DPYTHON=... -DSOURCE=... -DSUMMARY=... -DLOG=... -DARCHS=90 -P check_ptxas.cmake
string(REPLACE "," ";" _archs "${ARCHS}")
set(_gencode)
foreach(_arch IN LISTS _archs)
  list(APPEND _gencode "-gencode=arch=compute_${_arch},code=sm_${_arch}")
endforeach()
execute_process(
  COMMAND ${CCACHE} ${NVCC} -std=c++20 ${_gencode} -Xptxas -v -c -x cu ${SOURCE} -o ${LOG}.o
  OUTPUT_VARIABLE _out ERROR_VARIABLE _out RESULT_VARIABLE _rc)
file(WRITE ${LOG} "${_out}")
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "nvcc failed (${_rc}):\n${_out}")
endif()
execute_process(COMMAND ${PYTHON} ${SUMMARY} --require ${LOG} RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "ptxas: a kernel spills registers, or nothing was checked (report above; log ${LOG})")
endif()
