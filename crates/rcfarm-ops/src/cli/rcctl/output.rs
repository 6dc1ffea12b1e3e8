//! Output for people (aligned tables) and for scripts (`--json`).

use serde::Serialize;

use crate::cli::CliError;

/// Prints `value` as pretty JSON.
pub fn json<T: Serialize + ?Sized>(value: &T) -> Result<(), CliError> {
    let s = serde_json::to_string_pretty(value).map_err(|e| CliError::Failed(e.to_string()))?;
    println!("{s}");
    Ok(())
}

/// A plain aligned table: a header row and data rows.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn print(&self) {
        let cols = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(cols) {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut out = String::new();
            for (i, c) in cells.iter().enumerate().take(cols) {
                if i + 1 == cols {
                    out.push_str(c);
                } else {
                    out.push_str(c);
                    out.push_str(&" ".repeat(widths[i] - c.chars().count() + 2));
                }
            }
            println!("{}", out.trim_end());
        };
        line(&self.header);
        for r in &self.rows {
            line(r);
        }
    }
}

pub use crate::cli::parse_pairs;

/// Prints the Consul transaction a write would send (for `--dry-run`).
pub fn print_txn(ops: &[crate::consul::TxnOp]) -> Result<(), CliError> {
    println!("# dry run: the transaction that would be sent (PUT /v1/txn); nothing was written");
    json(ops)
}
