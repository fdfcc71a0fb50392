//! One callgrind dump, read from callgrind's own format (no `callgrind_annotate`): each
//! function's own instructions and the inclusive instructions of its calls, per callee.
//!
//! Layers. A layer is a set of functions that start it; an instruction belongs to the
//! innermost layer whose function is on the stack when it runs, or to no layer. Callgrind keeps
//! no stacks, only the call graph with each edge's inclusive count, so the layer mix of a
//! function is propagated along the graph in proportion to what each caller's calls cost (as
//! gprof does): exact where a function is called from one layer only, an apportioning where a
//! helper is shared. What this keeps:
//! - every instruction of the dump is in exactly one row (the rows add up to the functions' own
//!   counts; a layer's function called inside another layer's is counted once, in its own);
//! - a function's name is one row however many source files callgrind lists it under (inlined
//!   code) and whichever object it is in.

use std::collections::HashMap;
use std::path::Path;

/// One dump: functions by name, their own counts, and their calls.
#[derive(Debug, Default)]
pub struct Profile {
    /// The dump's `summary:`/`totals:` count.
    pub total: u64,
    names: Vec<String>,
    own: Vec<u64>,
    /// Per caller: (callee, inclusive count of all its calls to it).
    calls: Vec<HashMap<usize, u64>>,
}

impl Profile {
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)?;
        Self::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    /// Parses callgrind's format (compressed or plain names, one event: Ir).
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let mut p = Self::default();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        let mut by_id: HashMap<String, usize> = HashMap::new();
        let mut current: Option<usize> = None;
        let mut callee: Option<usize> = None;
        let mut next_is_call = false;
        let mut total = None;
        for (n, line) in text.lines().enumerate() {
            let mut function = |spec: &str| -> anyhow::Result<usize> {
                p.function(&mut by_name, &mut by_id, spec)
                    .ok_or_else(|| anyhow::anyhow!("line {}: unknown function {spec:?}", n + 1))
            };
            if let Some(spec) = line.strip_prefix("fn=") {
                current = Some(function(spec)?);
            } else if let Some(spec) = line.strip_prefix("cfn=") {
                callee = Some(function(spec)?);
            } else if line.starts_with("calls=") {
                next_is_call = true;
            } else if let Some(t) = line
                .strip_prefix("summary:")
                .or_else(|| line.strip_prefix("totals:"))
            {
                total = t.split_whitespace().next().and_then(|v| v.parse().ok());
            } else if line.starts_with(|c: char| c.is_ascii_digit() || "+-*".contains(c)) {
                let ir = cost_of(line)
                    .ok_or_else(|| anyhow::anyhow!("line {}: bad cost line {line:?}", n + 1))?;
                let f =
                    current.ok_or_else(|| anyhow::anyhow!("line {}: cost before fn=", n + 1))?;
                if std::mem::take(&mut next_is_call) {
                    let to = callee
                        .ok_or_else(|| anyhow::anyhow!("line {}: calls= without cfn=", n + 1))?;
                    *p.calls[f].entry(to).or_default() += ir;
                } else {
                    p.own[f] += ir;
                }
            }
        }
        p.total = total.ok_or_else(|| anyhow::anyhow!("no summary: or totals: line"))?;
        Ok(p)
    }

    /// The index of `(id) name`, `(id)` (a name given before) or a plain `name`.
    fn function(
        &mut self,
        by_name: &mut HashMap<String, usize>,
        by_id: &mut HashMap<String, usize>,
        spec: &str,
    ) -> Option<usize> {
        let (id, name) = match spec.strip_prefix('(') {
            Some(rest) => {
                let (id, name) = rest.split_once(')')?;
                (Some(id), name.trim_start())
            }
            None => (None, spec),
        };
        if name.is_empty() {
            return by_id.get(id?).copied();
        }
        let index = *by_name.entry(name.to_owned()).or_insert_with(|| {
            self.names.push(name.to_owned());
            self.own.push(0);
            self.calls.push(HashMap::new());
            self.names.len() - 1
        });
        if let Some(id) = id {
            by_id.insert(id.to_owned(), index);
        }
        Some(index)
    }

    /// The sum of the functions' own counts (the dump's instructions, as its functions hold them).
    #[cfg(test)]
    fn own_total(&self) -> u64 {
        self.own.iter().sum()
    }

    /// Each function's own count (its instructions, not its calls').
    pub fn own(&self) -> HashMap<&str, u64> {
        self.names
            .iter()
            .map(String::as_str)
            .zip(self.own.iter().copied())
            .collect()
    }

    /// Each function's inclusive count: what its callers' calls to it cost, or for a function
    /// nobody calls (a thread's start), its own count and its calls'.
    pub fn inclusive(&self) -> HashMap<&str, u64> {
        let mut called: Vec<Option<u64>> = vec![None; self.names.len()];
        for (from, calls) in self.calls.iter().enumerate() {
            for (&to, &ir) in calls {
                if to != from {
                    *called[to].get_or_insert(0) += ir;
                }
            }
        }
        (0..self.names.len())
            .map(|f| {
                let ir = called[f].unwrap_or_else(|| self.own[f] + self.outgoing(f));
                (self.names[f].as_str(), ir)
            })
            .collect()
    }

    fn outgoing(&self, f: usize) -> u64 {
        self.calls[f]
            .iter()
            .filter(|&(&to, _)| to != f)
            .map(|(_, ir)| ir)
            .sum()
    }

    /// The functions' own counts divided among `layers` rows plus a last row for no layer:
    /// `layer_of` names the layer a function starts (see the module's doc).
    pub fn by_layer(&self, layers: usize, layer_of: impl Fn(&str) -> Option<usize>) -> Vec<f64> {
        let n = self.names.len();
        let rows = layers + 1;
        let starts: Vec<Option<usize>> = self.names.iter().map(|f| layer_of(f)).collect();
        assert!(
            starts.iter().flatten().all(|&l| l < layers),
            "a layer index out of range"
        );
        let mut called = vec![false; n];
        for (from, calls) in self.calls.iter().enumerate() {
            for &to in calls.keys() {
                called[to] |= to != from;
            }
        }
        // mix[f]: the fraction of f's work in each row. Functions nobody calls start in their
        // own layer or in none; the rest take their callers' mix, weighted by the calls' counts.
        let mut mix: Vec<Vec<f64>> = (0..n)
            .map(|f| {
                let mut m = vec![0.0; rows];
                if !called[f] {
                    m[starts[f].unwrap_or(layers)] = 1.0;
                }
                m
            })
            .collect();
        let order = self.callers_first();
        // Acyclic parts settle in one pass in callers-first order; a recursion's mix converges
        // over the passes.
        for _ in 0..64 {
            let mut inflow = vec![vec![0.0; rows]; n];
            for &from in &order {
                for (&to, &ir) in &self.calls[from] {
                    if to == from {
                        continue;
                    }
                    #[allow(clippy::cast_precision_loss)]
                    let ir = ir as f64;
                    match starts[to] {
                        Some(l) => inflow[to][l] += ir,
                        None => {
                            for (row, share) in mix[from].iter().enumerate() {
                                inflow[to][row] += ir * share;
                            }
                        }
                    }
                }
            }
            let mut change: f64 = 0.0;
            for f in (0..n).filter(|&f| called[f]) {
                let sum: f64 = inflow[f].iter().sum();
                if sum > 0.0 {
                    for row in 0..rows {
                        let share = inflow[f][row] / sum;
                        change = change.max((share - mix[f][row]).abs());
                        mix[f][row] = share;
                    }
                }
            }
            if change < 1e-9 {
                break;
            }
        }
        let mut out = vec![0.0; rows];
        for (m, &own) in mix.iter().zip(&self.own) {
            let placed: f64 = m.iter().sum();
            #[allow(clippy::cast_precision_loss)]
            let own = own as f64;
            if placed == 0.0 {
                // Called only with no instructions on the calls (cannot place it): no layer.
                out[layers] += own;
            } else {
                for (row, share) in out.iter_mut().zip(m) {
                    *row += own * share / placed;
                }
            }
        }
        out
    }

    /// The functions in an order where a caller comes before what it calls, except along a
    /// recursion (depth-first from the functions nobody calls, then from the rest).
    fn callers_first(&self) -> Vec<usize> {
        let n = self.names.len();
        let mut seen = vec![false; n];
        let mut post = Vec::with_capacity(n);
        let mut called = vec![false; n];
        for (from, calls) in self.calls.iter().enumerate() {
            for &to in calls.keys() {
                called[to] |= to != from;
            }
        }
        let starts = (0..n).filter(|&f| !called[f]).chain(0..n);
        for start in starts {
            if seen[start] {
                continue;
            }
            seen[start] = true;
            let mut stack = vec![(start, self.calls[start].keys().copied().collect::<Vec<_>>())];
            while let Some((f, pending)) = stack.last_mut() {
                if let Some(next) = pending.pop() {
                    if !seen[next] {
                        seen[next] = true;
                        let callees = self.calls[next].keys().copied().collect();
                        stack.push((next, callees));
                    }
                } else {
                    post.push(*f);
                    stack.pop();
                }
            }
        }
        post.reverse();
        post
    }
}

/// The Ir count of a cost line (`<position> <Ir>`, the position possibly relative or `*`);
/// a line with the position only has no instructions.
fn cost_of(line: &str) -> Option<u64> {
    let mut fields = line.split_whitespace();
    fields.next()?;
    fields.next().map_or(Some(0), |ir| ir.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// main calls plan (layer 0) twice and write (layer 1) once; plan calls write (inside
    /// plan: counted in layer 1, not twice) and a helper also called from main.
    const DUMP: &str = "\
events: Ir
summary: 1000
fl=(1) a.rs
fn=(1) main
1 100
cfn=(2) app::plan
calls=2 5
2 500
cfn=(3) app::write
calls=1 9
3 150
cfn=(4) helper
calls=1 9
4 50
fi=(2) b.rs
fn=(2)
5 200
cfn=(3)
calls=1 9
+1 100
cfn=(4)
calls=1 9
* 200
fn=(3)
9 250
fn=(4)
9 250
";

    #[test]
    fn every_instruction_is_in_one_row() {
        let p = Profile::parse(DUMP).unwrap();
        assert_eq!(p.total, 1000);
        assert_eq!(p.own_total(), 100 + 200 + 250 + 250);
        let layer = |f: &str| match f {
            f if f.ends_with("::plan") => Some(0),
            f if f.ends_with("::write") => Some(1),
            _ => None,
        };
        let rows = p.by_layer(2, layer);
        // helper's 250: 200 of its calls' 250 come from plan, 50 from main.
        assert!(
            (rows[0] - (200.0 + 250.0 * 200.0 / 250.0)).abs() < 1e-6,
            "{rows:?}"
        );
        assert!((rows[1] - 250.0).abs() < 1e-6, "{rows:?}");
        assert!((rows[2] - (100.0 + 50.0)).abs() < 1e-6, "{rows:?}");
        let sum: f64 = rows.iter().sum();
        #[allow(clippy::cast_precision_loss)]
        let own = p.own_total() as f64;
        assert!((sum - own).abs() < 1e-6);
    }

    #[test]
    fn inclusive_counts_merge_a_name_and_start_at_uncalled_functions() {
        let p = Profile::parse(DUMP).unwrap();
        let inc = p.inclusive();
        assert_eq!(p.own()["app::plan"], 200);
        assert_eq!(inc["main"], 100 + 500 + 150 + 50);
        assert_eq!(inc["app::plan"], 500);
        assert_eq!(inc["app::write"], 250);
        assert_eq!(inc["helper"], 250);
    }

    #[test]
    fn a_recursion_settles() {
        let text = "summary: 30\nfn=(1) main\n1 10\ncfn=(2) app::plan\ncalls=1 1\n1 20\n\
                    fn=(2)\n1 10\ncfn=(3) r\ncalls=1 1\n1 10\nfn=(3)\n1 5\ncfn=(2)\ncalls=1 1\n1 5\n";
        let p = Profile::parse(text).unwrap();
        let rows = p.by_layer(1, |f| f.ends_with("::plan").then_some(0));
        assert!((rows[0] - 15.0).abs() < 1e-6, "{rows:?}");
        assert!((rows[1] - 10.0).abs() < 1e-6, "{rows:?}");
    }

    #[test]
    fn a_bad_cost_line_is_an_error() {
        assert!(Profile::parse("summary: 1\nfn=(1) f\n1 x\n").is_err());
        assert!(Profile::parse("fn=(1) f\n1 1\n").is_err());
        assert!(Profile::parse("summary: 1\nfn=(9)\n").is_err());
    }
}
