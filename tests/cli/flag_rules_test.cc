// The one parser of integer and size flags (cli/flag_rules.h, docs/notes/flags.md). Regression
// for issue #26: `--batch 0` trained silently with the planner's choice; "12abc", negatives and
// overflow each got a different message, or none (a negative --seed wrapped around).
#include "cli/flag_rules.h"

#include <gtest/gtest.h>

#include <string>

namespace headroom::cli {
namespace {

constexpr IntRule kCount{
    .max = 1000, .what = "the micro-batch in sequences", .auto_means = "the planner's choice"};
constexpr IntRule kZeroMeansNone{.min = 0, .what = "steps"};

std::string error_of(std::string_view text, const IntRule& rule) {
  Result<std::optional<uint64_t>> r = parse_int_flag("--batch", text, rule);
  return r.is_ok() ? std::string("accepted") : r.status().message();
}

bool has(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

TEST(FlagRules, AcceptsWholeNumbersInRangeAndAutoWhereItIsMeant) {
  EXPECT_EQ(**parse_int_flag("--batch", "8", kCount), 8u);
  EXPECT_EQ(**parse_int_flag("--batch", "+8", kCount), 8u);
  EXPECT_EQ(**parse_int_flag("--batch", "1000", kCount), 1000u);
  EXPECT_EQ(**parse_int_flag("--batch", "0007", kCount), 7u);
  EXPECT_FALSE(parse_int_flag("--batch", "auto", kCount)->has_value());
  EXPECT_EQ(**parse_int_flag("--save-every", "0", kZeroMeansNone), 0u);
  EXPECT_FALSE(parse_int_flag("--save-every", "auto", kZeroMeansNone).is_ok());
  constexpr IntRule kSeed{.min = 0, .max = UINT64_MAX};
  EXPECT_EQ(**parse_int_flag("--seed", "18446744073709551615", kSeed), UINT64_MAX);
}

TEST(FlagRules, ZeroIsRefusedWhereCountsStartAtOneAndSaysWhatToDo) {
  const std::string e = error_of("0", kCount);
  EXPECT_TRUE(has(e, "--batch 0: must be at least 1")) << e;
  EXPECT_TRUE(has(e, "the micro-batch in sequences")) << e;
  EXPECT_TRUE(has(e, "give --batch auto for the planner's choice")) << e;
}

TEST(FlagRules, NegativesAreRefusedNotWrapped) {
  for (const char* v : {"-1", "-8", "-18446744073709551615", "-99999999999999999999999"}) {
    const std::string e = error_of(v, kCount);
    EXPECT_TRUE(has(e, std::string("--batch ") + v + ": must not be negative")) << e;
  }
  constexpr IntRule kSeed{.min = 0, .max = UINT64_MAX};
  EXPECT_FALSE(parse_int_flag("--seed", "-1", kSeed).is_ok());
}

TEST(FlagRules, OverflowIsTooLarge) {
  for (const char* v : {"1001", "2147483648", "18446744073709551615", "18446744073709551616",
                        "99999999999999999999999999"}) {
    const std::string e = error_of(v, kCount);
    EXPECT_TRUE(has(e, std::string("--batch ") + v + ": too large")) << e;
    EXPECT_TRUE(has(e, "from 1 to 1000, or auto (the planner's choice)")) << e;
  }
}

TEST(FlagRules, GarbageIsNotAWholeNumber) {
  for (const char* v :
       {"12abc", "abc", "", " 8", "8 ", "1e3", "0x10", "1.5", "+", "-", "8k", "AUTO", "\xFF"}) {
    const std::string e = error_of(v, kCount);
    EXPECT_TRUE(has(e, "not a whole number")) << v << ": " << e;
    EXPECT_TRUE(has(e, "--batch ")) << e;
  }
  // The value is quoted as valid UTF-8 (messages may end up in JSON).
  EXPECT_TRUE(has(error_of("\xFF", kCount), "--batch \xEF\xBF\xBD")) << error_of("\xFF", kCount);
}

TEST(FlagRules, SizesArePositiveOrAuto) {
  EXPECT_EQ(**parse_size_flag("--device-memory", "4GiB", true), 4ull << 30);
  EXPECT_FALSE(parse_size_flag("--device-memory", "auto", true)->has_value());
  EXPECT_FALSE(parse_size_flag("--device-memory", "auto", false).is_ok());
  for (const char* v : {"0", "0GiB", "0.0"}) {
    Result<std::optional<uint64_t>> r = parse_size_flag("--device-memory", v, true);
    ASSERT_FALSE(r.is_ok()) << v;
    EXPECT_TRUE(has(r.status().message(), std::string("--device-memory ") + v + ": ")) << v;
    EXPECT_TRUE(has(r.status().message(), "positive size")) << r.status().message();
  }
  for (const char* v : {"12abc", "-1GiB", "lots", "4 parsecs", "99999999999TiB", "1e400"}) {
    Result<std::optional<uint64_t>> r = parse_size_flag("--offload-memory", v, true);
    ASSERT_FALSE(r.is_ok()) << v;
    EXPECT_TRUE(has(r.status().message(), std::string("--offload-memory ") + v + ": not a size"))
        << r.status().message();
  }
}

}  // namespace
}  // namespace headroom::cli
