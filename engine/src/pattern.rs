//! Include / exclude / priority patterns. A database pattern is a glob over the database name. A
//! relation pattern is a glob over `schema.table` (or over the table name alone when it has no dot),
//! optionally prefixed by `database:`. Indexes and TOAST relations follow the table they belong to.
//! Globs: `*` any run of characters, `?` one character; everything else is literal.

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RelationPattern {
    pub text: String,
    database: Option<String>,
    relation: String,
}

impl RelationPattern {
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        if t.is_empty() {
            return Err(Error::InvalidInput("empty relation pattern".into()));
        }
        let (database, relation) = match t.split_once(':') {
            Some((d, r)) if !d.is_empty() && !r.is_empty() => (Some(d.to_string()), r.to_string()),
            Some(_) => {
                return Err(Error::InvalidInput(format!("relation pattern {t:?} is not [database:]schema.table")))
            }
            None => (None, t.to_string()),
        };
        Ok(RelationPattern { text: t.to_string(), database, relation })
    }

    pub fn matches(&self, database: &str, schema: &str, table: &str) -> bool {
        if let Some(d) = &self.database {
            if !glob(d, database) {
                return false;
            }
        }
        if self.relation.contains('.') {
            glob(&self.relation, &format!("{schema}.{table}"))
        } else {
            glob(&self.relation, table)
        }
    }

    /// Whether the pattern could match something in `database` at all.
    pub fn applies_to_database(&self, database: &str) -> bool {
        self.database.as_deref().is_none_or(|d| glob(d, database))
    }
}

/// Glob match with `*` and `?`, on characters (not bytes), iterative with backtracking.
pub fn glob(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob("*", ""));
        assert!(glob("a*c", "abbbc"));
        assert!(glob("a?c", "abc"));
        assert!(!glob("a?c", "ac"));
        assert!(glob("sales_2024*", "sales_2024_q1"));
        assert!(!glob("sales", "sales_x"));
        assert!(glob("é*ü", "éaü"));
    }

    #[test]
    fn relation_patterns() {
        let p = RelationPattern::parse("public.orders*").unwrap();
        assert!(p.matches("app", "public", "orders_2024"));
        assert!(!p.matches("app", "audit", "orders"));
        let p = RelationPattern::parse("orders").unwrap();
        assert!(p.matches("app", "any", "orders"));
        let p = RelationPattern::parse("app*:public.t").unwrap();
        assert!(p.matches("app2", "public", "t"));
        assert!(!p.matches("other", "public", "t"));
        // A dot in a schema or table name: the pattern is matched against the whole `schema.table`,
        // never split at its first dot.
        let p = RelationPattern::parse("my.schema.t*").unwrap();
        assert!(p.matches("db", "my.schema", "t1"));
        assert!(p.matches("db", "my", "schema.t2"));
        assert!(RelationPattern::parse(":x").is_err());
        assert!(RelationPattern::parse("  ").is_err());
    }
}
