// A second translation unit including rdist.hpp: with hpp_cxx17.cpp it
// checks that everything in the header is inline (no duplicate symbols).
#include "rdist.hpp"

int other_translation_unit(rdist::Comm& comm) {
  std::vector<float> v(3, 1.0f);
  try {
    comm.allreduce(v, RDIST_SUM);
  } catch (const rdist::Error& e) {
    return static_cast<int>(e.code());
  }
  return 0;
}
