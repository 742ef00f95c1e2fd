#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -5383,7 +5383,7 @@
     'Non-decreasing indices, lazily consumed'
     num_read = 0
     for index in indices:
-        advance = index - num_read
+        advance = index + num_read
         try:
             value = next(islice(iterator, advance, None))
         except ValueError:
SLIME_ENV_SWE_PATCH
