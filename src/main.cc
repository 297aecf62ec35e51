// The headroom executable: everything lives in the cli layer.
#include "cli/cli.h"

int main(int argc, char** argv) { return headroom::cli::run(argc, argv); }
