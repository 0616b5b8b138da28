#include <iostream>
#include "zerotrain/version.h"
int main() { std::cout << zt::version() << "\n"; }
