//! [`Op`]: the one list of store operations, by which they are timed,
//! counted and (in tests) made to fail.

/// A store operation: the methods of [`Store`](super::Store),
/// [`ListRecords`](super::ListRecords) and [`Purge`](super::Purge).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `reserve`.
    Reserve,
    /// `get`.
    Get,
    /// `resolve`.
    Resolve,
    /// `release`.
    Release,
    /// `mark_unknown`.
    MarkUnknown,
    /// `renew`.
    Renew,
    /// `list`.
    List,
    /// `purge_expired`.
    Purge,
    /// `delete`.
    Delete,
}

impl Op {
    /// How many operations there are: `op as usize` is below it, so a
    /// table of `[T; Op::COUNT]` has a place for each.
    pub const COUNT: usize = Self::ALL.len();

    /// Every operation, in declaration order (`op as usize` indexes it).
    pub const ALL: [Op; 9] = [
        Self::Reserve,
        Self::Get,
        Self::Resolve,
        Self::Release,
        Self::MarkUnknown,
        Self::Renew,
        Self::List,
        Self::Purge,
        Self::Delete,
    ];

    /// Its name, as in the metrics' `op` label.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Reserve => "reserve",
            Self::Get => "get",
            Self::Resolve => "resolve",
            Self::Release => "release",
            Self::MarkUnknown => "mark_unknown",
            Self::Renew => "renew",
            Self::List => "list",
            Self::Purge => "purge",
            Self::Delete => "delete",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_each_operation_at_its_index() {
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i, "{op:?}");
        }
        assert_eq!(Op::COUNT, 9);
    }
}
