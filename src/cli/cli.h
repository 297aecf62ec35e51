// The command-line front end: parses subcommands and flags, prints human or JSON output.
#pragma once

namespace headroom::cli {
// Runs the headroom command line; returns the process exit code.
int run(int argc, char** argv);
}  // namespace headroom::cli
