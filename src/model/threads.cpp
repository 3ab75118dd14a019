#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "model/llama.hpp"

namespace kvcodec::model {

int auto_thread_count() {
  const int cores = omp_get_num_procs();
  double load[1] = {0.0};
  if (getloadavg(load, 1) != 1) return cores;
  // Cores nobody else is using (rounded down, at least one).
  const int idle = int(std::floor(double(cores) - load[0] + 0.5));
  return std::max(1, std::min(cores, idle));
}

}  // namespace kvcodec::model
