// Sets automerge-repo's sync debounce, which 2.5.6 does not expose: its
// DocSynchronizer declares `syncDebounceRate = 100` as a class field and
// throttles every sync to peers by it. This module-load hook rewrites that
// one line of that one file as Node.js loads it (node_modules stays as
// installed). bench.mjs registers it with `--import` in the child
// processes when `--sync-debounce-ms` is given.
import { register } from "node:module";

const ms = Number(process.env.NUWA_AM_SYNC_DEBOUNCE_MS);
if (Number.isInteger(ms) && ms >= 0) {
  register(
    "data:text/javascript," +
      encodeURIComponent(`
        export async function load(url, context, next) {
          const r = await next(url, context);
          if (url.endsWith("/automerge-repo/dist/synchronizer/DocSynchronizer.js")) {
            const src = String(r.source);
            const out = src.replace("syncDebounceRate = 100;", "syncDebounceRate = ${ms};");
            if (out === src) throw new Error("debounce-hook: syncDebounceRate not found");
            return { ...r, source: out };
          }
          return r;
        }`),
  );
}
