// The launch ABI shared by the runtime (msl_runtime.cpp) and generated kernel launchers: the
// values of every thread-position attribute for one thread. Needs `uint` and `uint3` defined.
#pragma once

struct msl_thread_info {
  uint dispatch_quadgroups_per_threadgroup;
  uint dispatch_simdgroups_per_threadgroup;
  uint3 dispatch_threads_per_threadgroup;
  uint3 grid_origin;
  uint3 grid_size;
  uint quadgroup_index_in_threadgroup;
  uint quadgroups_per_threadgroup;
  uint simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup;
  uint thread_execution_width;
  uint thread_index_in_quadgroup;
  uint thread_index_in_simdgroup;
  uint thread_index_in_threadgroup;
  uint3 thread_position_in_grid;
  uint3 thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid;
  uint3 threadgroups_per_grid;
  uint3 threads_per_grid;
  uint threads_per_simdgroup;
  uint3 threads_per_threadgroup;
};
