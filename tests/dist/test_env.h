// The communicator of the running test job (dist_tests' main makes it): the local one when the
// binary runs alone, MPI when it runs under mpirun. Tests are written for any size.
//
// Rule for tests here: every rank runs the same collectives in the same order whatever the
// outcome of its checks (compute first, EXPECT after), so a failing check never leaves a rank
// waiting; ctest's timeout is the backstop.
#pragma once

#include "dist/communicator.h"

namespace headroom::dist::test {
Communicator& world();
}  // namespace headroom::dist::test
