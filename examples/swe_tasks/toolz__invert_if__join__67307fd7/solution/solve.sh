#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -915,10 +915,10 @@
                 key = rightkey(item)
                 seen(key)
                 if key in d:
+                    yield (left_default, item)
+                else:
                     for left_match in d[key]:
                         yield (left_match, item)
-                else:
-                    yield (left_default, item)
 
         for key, matches in d.items():
             if key not in seen_keys:
SLIME_ENV_SWE_PATCH
