#include <gtest/gtest.h>
#include "zerotrain/version.h"
TEST(Version, IsSet) { EXPECT_STREQ(zt::version(), "0.1.0"); }
