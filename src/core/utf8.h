// Text that goes into JSON: one policy for every writer (docs/notes/json-text.md). JSON strings
// must be valid UTF-8, and a byte-level BPE model, a path or a prompt need not be.
#pragma once

#include <string>
#include <string_view>

namespace headroom {

// Whether `s` is well-formed UTF-8 (Unicode 15, table 3-7: no overlong forms, no surrogates
// U+D800..U+DFFF, nothing above U+10FFFF).
bool is_valid_utf8(std::string_view s);

// `s` with every ill-formed sequence replaced by U+FFFD (EF BF BD), one per maximal subpart
// (Unicode 15, section 3.9, "U+FFFD Substitution of Maximal Subparts", as the WHATWG decoder and
// nlohmann::json's error_handler_t::replace do): a lead byte and the continuation bytes that
// could still have completed it become one U+FFFD, and the byte that broke the sequence is read
// again as the start of the next one. Valid text is returned unchanged.
std::string valid_utf8(std::string_view s);
// The same, appended to `out`.
void append_valid_utf8(std::string& out, std::string_view s);

// JSON text of an nlohmann::json (or ordered_json) value under the policy above: invalid UTF-8
// in any string becomes U+FFFD, never an exception (type_error 316). A template so that core
// needs no JSON library; `indent` as in json::dump (-1: one line).
template <typename Json>
std::string dump_json(const Json& j, int indent = -1) {
  return j.dump(indent, ' ', false, Json::error_handler_t::replace);
}

}  // namespace headroom
