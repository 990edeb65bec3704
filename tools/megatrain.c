/* The megatrain command: plan, train, bench. */
#include <stdio.h>
int main(void) { puts("megatrain: to be written"); return 0; }
