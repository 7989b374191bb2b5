//! Prometheus pages: scraping a role's `/metrics` and reading its samples.

/// Samples of a Prometheus text page, `name{labels}` -> value. Every sample of a role's page
/// carries `model_name` and `role`; keys leave those two out, the other labels in page order.
pub fn parse_metrics(page: &str) -> std::collections::HashMap<String, f64> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((without_role_labels(k), v.parse().ok()?))
        })
        .collect()
}

/// `name{labels}` without its `model_name` and `role` labels (asserting they are there).
fn without_role_labels(key: &str) -> String {
    let (name, labels) = key.split_once('{').expect("every sample is labelled");
    let labels = labels.strip_suffix('}').expect("labels end with }");
    let mut kept = Vec::new();
    let mut seen = 0;
    let mut rest = labels;
    while !rest.is_empty() {
        let (k, after) = rest.split_once("=\"").expect("label=\"value\"");
        // The value runs to the first quote not escaped by a backslash.
        let mut end = 0;
        let bytes = after.as_bytes();
        while bytes[end] != b'"' {
            end += if bytes[end] == b'\\' { 2 } else { 1 };
        }
        let v = &after[..end];
        if k == "model_name" || k == "role" {
            seen += 1;
        } else {
            kept.push(format!("{k}=\"{v}\""));
        }
        rest = after[end + 1..].trim_start_matches(',');
    }
    assert_eq!(seen, 2, "{key}: model_name and role on every sample");
    if kept.is_empty() {
        name.to_string()
    } else {
        format!("{name}{{{}}}", kept.join(","))
    }
}

/// The `/metrics` page of `addr` (host:port or a URL), or `None` while it cannot be reached.
pub async fn try_scrape(addr: &str) -> Option<std::collections::HashMap<String, f64>> {
    let url = if addr.starts_with("http") {
        format!("{addr}/metrics")
    } else {
        format!("http://{addr}/metrics")
    };
    let body = reqwest::get(url).await.ok()?.text().await.ok()?;
    Some(parse_metrics(&body))
}

/// The `/metrics` page of `addr`, which must answer.
pub async fn scrape(addr: &str) -> std::collections::HashMap<String, f64> {
    try_scrape(addr)
        .await
        .unwrap_or_else(|| panic!("{addr}/metrics did not answer"))
}

/// One sample of a scrape (0 when absent).
pub fn metric(m: &std::collections::HashMap<String, f64>, key: &str) -> f64 {
    m.get(key).copied().unwrap_or(0.0)
}
