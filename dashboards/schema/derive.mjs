// Turns Grafana's published TypeScript types (@grafana/schema, pinned in package.json to the
// Grafana image of docker-compose.yml) into one JSON Schema file for the dashboard test:
//   dashboard, panel, row          the dashboard JSON model (schemaVersion 41 era)
//   panels.<type>.options          each panel plugin's options
//   panels.<type>.fieldConfig      each panel plugin's fieldConfig.defaults.custom
//   dataLink                       a data link (fieldConfig.defaults.links[])
//   query                          a Prometheus target
// Every interface becomes a closed object (additionalProperties: false), so a key Grafana no
// longer knows is a violation. Run by scripts/bootstrap; writes derived/grafana-schema.json.
import { createGenerator } from "ts-json-schema-generator";
import { readFileSync, readdirSync, mkdirSync, writeFileSync, existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const pkg = join(here, "node_modules", "@grafana", "schema");
const types = join(pkg, "dist", "types");
const out = join(here, "derived", "grafana-schema.json");

function schemas(path, names) {
  const gen = createGenerator({
    path,
    tsconfig: join(here, "tsconfig.json"),
    skipTypeCheck: true,
    expose: "export",
    topRef: false,
    jsDoc: "none",
    additionalProperties: false,
  });
  const result = {};
  for (const name of names) {
    result[name] = gen.createSchema(name);
  }
  return result;
}

const started = Date.now();
const log = (msg) => process.stderr.write(`[grafana-schema] ${msg}\n`);
const version = JSON.parse(readFileSync(join(pkg, "package.json"), "utf8")).version;
const { defaultDashboard } = await import(join(pkg, "dist", "esm", "raw", "dashboard", "x", "dashboard_types.gen.mjs"));

log(`deriving from @grafana/schema ${version}`);
const dash = schemas(join(types, "raw", "dashboard", "x", "dashboard_types.gen.d.ts"), ["Dashboard", "Panel", "RowPanel"]);
const v2 = schemas(join(types, "schema", "dashboard", "v2alpha1", "types.spec.gen.d.ts"), ["DataLink"]);
const query = schemas(join(here, "prometheus-query.ts"), ["PrometheusQuery"]);

const panels = {};
const composable = join(types, "raw", "composable");
const dirs = readdirSync(composable).filter((d) => existsSync(join(composable, d, "panelcfg")));
for (const [i, dir] of dirs.entries()) {
  const xdir = join(composable, dir, "panelcfg", "x");
  const file = readdirSync(xdir).find((f) => f.endsWith("_types.gen.d.ts"));
  const text = readFileSync(join(xdir, file), "utf8");
  const names = ["Options", "FieldConfig"].filter((n) => new RegExp(`export (interface|type) ${n}\\b`).test(text));
  try {
    const got = schemas(join(xdir, file), names);
    panels[dir] = { options: got.Options ?? {}, fieldConfig: got.FieldConfig ?? {} };
    log(`panel ${i + 1}/${dirs.length}: ${dir}`);
  } catch (err) {
    // A few plugins' types do not convert (geomap names one type twice). Left out, so a
    // dashboard using that panel type fails the test for want of a schema, not silently.
    log(`panel ${i + 1}/${dirs.length}: ${dir} left out (${String(err.message).split("\n")[0]})`);
  }
}

mkdirSync(dirname(out), { recursive: true });
writeFileSync(
  out,
  JSON.stringify(
    {
      grafanaSchemaVersion: version,
      schemaVersion: defaultDashboard.schemaVersion,
      dashboard: dash.Dashboard,
      panel: dash.Panel,
      row: dash.RowPanel,
      dataLink: v2.DataLink,
      query: query.PrometheusQuery,
      panels,
    },
    null,
    1,
  ) + "\n",
);
log(`wrote ${out} in ${((Date.now() - started) / 1000).toFixed(1)}s`);
