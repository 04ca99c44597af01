//! Symbolic dimensions. A dimension is a polynomial with integer
//! coefficients over the model's symbolic sizes (`B`, `T`, ...): `768`,
//! `B*T`, `T+1`, `3*B`. Keeping them symbolic lets one graph serve every
//! batch size and sequence length, and lets shape errors print the names a
//! person wrote.

use std::collections::BTreeMap;
use std::fmt;

/// The size every tool reads as the batch: `--batch` sets it, data
/// parallelism splits it over the ranks, throughput counts its entries.
pub const BATCH: &str = "B";
/// The size read as the sequence length: `--seq` sets it, and token
/// streams are cut into windows of it.
pub const SEQ: &str = "T";
/// The source length of sentence pairs (the encoder's side; `T` is the
/// target's).
pub const SOURCE_SEQ: &str = "S";

/// A product of symbols, sorted, with repetition for powers (`B*B*T`).
type Monomial = Vec<String>;

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Dim {
    /// monomial -> coefficient, no zero coefficients kept.
    terms: BTreeMap<Monomial, i64>,
}

impl Dim {
    pub fn constant(n: i64) -> Dim {
        let mut terms = BTreeMap::new();
        if n != 0 {
            terms.insert(Vec::new(), n);
        }
        Dim { terms }
    }

    pub fn symbol(name: &str) -> Dim {
        let mut terms = BTreeMap::new();
        terms.insert(vec![name.to_string()], 1);
        Dim { terms }
    }

    /// `Some(n)` when the dimension does not depend on any symbol.
    pub fn as_const(&self) -> Option<i64> {
        match self.terms.len() {
            0 => Some(0),
            1 => self.terms.get(&Vec::new()).copied(),
            _ => None,
        }
    }

    pub fn is_one(&self) -> bool {
        self.as_const() == Some(1)
    }

    pub fn symbols(&self) -> impl Iterator<Item = &str> {
        self.terms.keys().flatten().map(|s| s.as_str())
    }

    pub fn checked_add(&self, other: &Dim) -> Option<Dim> {
        let mut terms = self.terms.clone();
        for (m, c) in &other.terms {
            let e = terms.entry(m.clone()).or_insert(0);
            *e = e.checked_add(*c)?;
            if *e == 0 {
                terms.remove(m);
            }
        }
        Some(Dim { terms })
    }

    pub fn checked_sub(&self, other: &Dim) -> Option<Dim> {
        self.checked_add(&other.checked_mul(&Dim::constant(-1))?)
    }

    pub fn checked_mul(&self, other: &Dim) -> Option<Dim> {
        let mut terms: BTreeMap<Monomial, i64> = BTreeMap::new();
        for (ma, ca) in &self.terms {
            for (mb, cb) in &other.terms {
                let mut m = ma.clone();
                m.extend(mb.iter().cloned());
                m.sort();
                let e = terms.entry(m.clone()).or_insert(0);
                *e = e.checked_add(ca.checked_mul(*cb)?)?;
                if *e == 0 {
                    terms.remove(&m);
                }
            }
        }
        Some(Dim { terms })
    }

    /// Exact division: by a constant that divides every coefficient, or by a
    /// dimension that is a factor of this one (`B*T / T = B`).
    pub fn checked_div(&self, other: &Dim) -> Option<Dim> {
        if let Some(d) = other.as_const() {
            if d == 0 {
                return None;
            }
            let mut terms = BTreeMap::new();
            for (m, c) in &self.terms {
                if c % d != 0 {
                    return None;
                }
                terms.insert(m.clone(), c / d);
            }
            return Some(Dim { terms });
        }
        // Divide by a single monomial with coefficient: every term must contain it.
        if other.terms.len() != 1 {
            return if self == other {
                Some(Dim::constant(1))
            } else {
                None
            };
        }
        let (om, oc) = other.terms.iter().next()?;
        let mut terms = BTreeMap::new();
        for (m, c) in &self.terms {
            if c % oc != 0 {
                return None;
            }
            let mut rest = m.clone();
            for s in om {
                let pos = rest.iter().position(|r| r == s)?;
                rest.remove(pos);
            }
            terms.insert(rest, c / oc);
        }
        Some(Dim { terms })
    }

    /// The value once every symbol is bound. `None` if a symbol is unbound
    /// or the arithmetic overflows.
    pub fn eval(&self, env: &dyn Fn(&str) -> Option<i64>) -> Option<i64> {
        let mut total: i64 = 0;
        for (m, c) in &self.terms {
            let mut v = *c;
            for s in m {
                v = v.checked_mul(env(s)?)?;
            }
            total = total.checked_add(v)?;
        }
        Some(total)
    }

    /// Replaces symbols by the dimensions given (unlisted symbols stay).
    pub fn substitute(&self, env: &dyn Fn(&str) -> Option<Dim>) -> Option<Dim> {
        let mut out = Dim::constant(0);
        for (m, c) in &self.terms {
            let mut t = Dim::constant(*c);
            for s in m {
                let d = env(s).unwrap_or_else(|| Dim::symbol(s));
                t = t.checked_mul(&d)?;
            }
            out = out.checked_add(&t)?;
        }
        Some(out)
    }
}

impl Dim {
    /// The dimension as a C expression over `long long` variables named
    /// like the symbols: `768LL*B*T`, `T + 1LL`.
    pub fn to_c(&self) -> String {
        if self.terms.is_empty() {
            return "0LL".into();
        }
        let mut out = String::new();
        for (i, (m, c)) in self.terms.iter().rev().enumerate() {
            let neg = *c < 0;
            if i > 0 {
                out.push_str(if neg { " - " } else { " + " });
            } else if neg {
                out.push('-');
            }
            let a = c.unsigned_abs();
            let mut factors: Vec<String> = Vec::new();
            if a != 1 || m.is_empty() {
                factors.push(format!("{a}LL"));
            }
            // Kernel parameters are the dimensions under `dim_`, apart from
            // the names kernels use for themselves (a dimension `C` or `S`).
            factors.extend(m.iter().map(|x| format!("dim_{x}")));
            out.push_str(&factors.join("*"));
        }
        // Parenthesised unless a single factor, so it can stand anywhere in
        // an expression (`i / (768LL*T)`).
        if out.contains(['*', ' ']) {
            format!("({out})")
        } else {
            out
        }
    }
}

impl From<i64> for Dim {
    fn from(n: i64) -> Dim {
        Dim::constant(n)
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.terms.is_empty() {
            return write!(f, "0");
        }
        // Highest-degree terms first, constants last: `B*T + 1`.
        let mut terms: Vec<_> = self.terms.iter().collect();
        terms.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(b.0)));
        for (i, (m, c)) in terms.iter().enumerate() {
            let c = **c;
            let neg = c < 0;
            if i == 0 {
                if neg {
                    write!(f, "-")?;
                }
            } else {
                write!(f, "{}", if neg { " - " } else { " + " })?;
            }
            let a = c.unsigned_abs();
            if m.is_empty() {
                write!(f, "{a}")?;
            } else {
                if a != 1 {
                    write!(f, "{a}*")?;
                }
                write!(f, "{}", m.join("*"))?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b() -> Dim {
        Dim::symbol("B")
    }
    fn t() -> Dim {
        Dim::symbol("T")
    }

    #[test]
    fn arithmetic_is_canonical() {
        let bt = b().checked_mul(&t()).unwrap();
        assert_eq!(bt, t().checked_mul(&b()).unwrap());
        assert_eq!(bt.to_string(), "B*T");
        let x = bt.checked_mul(&Dim::constant(3)).unwrap();
        assert_eq!(x.to_string(), "3*B*T");
        assert_eq!(x.checked_div(&Dim::constant(3)).unwrap(), bt);
        assert_eq!(bt.checked_div(&t()).unwrap(), b());
        assert!(b().checked_div(&t()).is_none());
        let tp1 = t().checked_add(&Dim::constant(1)).unwrap();
        assert_eq!(tp1.to_string(), "T + 1");
        assert_eq!(tp1.checked_sub(&Dim::constant(1)).unwrap(), t());
        assert_eq!(t().checked_sub(&t()).unwrap().as_const(), Some(0));
        assert_eq!(
            Dim::constant(-4).checked_add(&t()).unwrap().to_string(),
            "T - 4"
        );
    }

    #[test]
    fn c_expressions() {
        let bt = b()
            .checked_mul(&t())
            .unwrap()
            .checked_mul(&Dim::constant(768))
            .unwrap();
        assert_eq!(bt.to_c(), "(768LL*dim_B*dim_T)");
        assert_eq!(
            t().checked_add(&Dim::constant(1)).unwrap().to_c(),
            "(dim_T + 1LL)"
        );
        assert_eq!(Dim::constant(0).to_c(), "0LL");
        assert_eq!(Dim::constant(-3).to_c(), "-3LL");
        assert_eq!(t().to_c(), "dim_T");
    }

    #[test]
    fn eval_binds_symbols() {
        let d = b()
            .checked_mul(&t())
            .unwrap()
            .checked_add(&Dim::constant(2))
            .unwrap();
        let env = |s: &str| match s {
            "B" => Some(3),
            "T" => Some(5),
            _ => None,
        };
        assert_eq!(d.eval(&env), Some(17));
        assert_eq!(Dim::symbol("X").eval(&env), None);
    }
}
