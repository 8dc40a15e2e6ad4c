// The Prometheus query (a panel target) as Grafana 12.1.1 types it. The authoritative type is
// `Prometheus` in @grafana/prometheus's dist/types/dataquery.d.ts (same version), but that
// package imports @grafana/data and drags in Grafana's whole front-end to resolve it. These
// are its fields minus the two that need @grafana/data (`scopes`, `adhocFilters`, which
// inferwatch never writes), over the common DataQuery from @grafana/schema.
// The raw generated type (the package index also re-exports a veneer of the same name).
import type { DataQuery } from "./node_modules/@grafana/schema/dist/types/common/common.gen";

export interface PrometheusQuery extends DataQuery {
  editorMode?: "builder" | "code";
  exemplar?: boolean;
  expr: string;
  format?: "time_series" | "table" | "heatmap";
  instant?: boolean;
  intervalFactor?: number;
  legendFormat?: string;
  range?: boolean;
  groupByKeys?: string[];
}
