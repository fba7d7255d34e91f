# ctest driver for ptxas_no_spills_sm80 / _sm90: compiles ptxas_spill_check.cu (every CUDA kernel instantiation
# ropescale builds) with `nvcc -Xptxas -v` for each arch in ARCHS, writes the ptxas report to LOG and
# fails when a kernel spills or when ptxas printed nothing to check (scripts/ptxas_summary.py).
#   cmake [-DCCACHE=ccache] -DNVCC=... -DPYTHON=... -DSOURCE=... -DINCLUDE=... -DSUMMARY=... -DLOG=... -DARCHS=80,90
#         [-DPLANTED_SPILL=ON] -P check_ptxas.cmake
# PLANTED_SPILL compiles only a kernel that must spill (ROPESCALE_PLANTED_SPILL): the check must fail.
string(REPLACE "," ";" _archs "${ARCHS}")
set(_gencode)
set(_extra)
if(PLANTED_SPILL)
  set(_extra -DROPESCALE_PLANTED_SPILL)
endif()
foreach(_arch IN LISTS _archs)
  list(APPEND _gencode "-gencode=arch=compute_${_arch},code=sm_${_arch}")
endforeach()
execute_process(
  COMMAND ${CCACHE} ${NVCC} -std=c++20 --expt-relaxed-constexpr ${_gencode} -Xptxas -v ${_extra} -I ${INCLUDE} -c -x cu ${SOURCE}
          -o ${LOG}.o
  OUTPUT_VARIABLE _out ERROR_VARIABLE _out RESULT_VARIABLE _rc)
file(WRITE ${LOG} "${_out}")
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "nvcc failed (${_rc}):\n${_out}")
endif()
execute_process(COMMAND ${PYTHON} ${SUMMARY} --require ${LOG} RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "ptxas: a kernel spills registers, or nothing was checked (report above; log ${LOG})")
endif()
