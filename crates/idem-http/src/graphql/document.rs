//! A GraphQL document, parsed with Apollo's parser: the operation a
//! request selects, its type, and its normal form.

use std::collections::{BTreeMap, BTreeSet};

use apollo_parser::cst::{self, CstNode};
use apollo_parser::{Lexer, Parser, TokenKind};

/// The type of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperationType {
    /// `query`, or the shorthand `{ … }`.
    Query,
    /// `mutation`: the only type that runs something.
    Mutation,
    /// `subscription`.
    Subscription,
}

/// How large a document the route parses: beyond them a request is
/// refused unread by the service, so a hostile document costs the
/// gateway bounded work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Nesting depth (selection sets, lists, objects) the parser follows.
    pub recursion: usize,
    /// Tokens the lexer reads.
    pub tokens: usize,
}

impl Default for Limits {
    /// 200 levels and 50,000 tokens: deeper than any query a schema's
    /// depth limit allows, and a few hundred kilobytes of document.
    fn default() -> Self {
        Self {
            recursion: 200,
            tokens: 50_000,
        }
    }
}

/// The operation a request selects from its document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Selected {
    pub(super) kind: OperationType,
    pub(super) name: Option<String>,
    /// The operation and the fragments it spreads (by name, each once),
    /// as their tokens one space apart: whitespace, comments and commas
    /// (all insignificant in GraphQL) out, and the document's other
    /// definitions with them.
    pub(super) normal: String,
}

/// Parses `query` and selects the operation `name` names, or its only
/// one; the reason why not, for a refusal.
pub(super) fn select(query: &str, name: Option<&str>, limits: &Limits) -> Result<Selected, String> {
    let tree = Parser::new(query)
        .recursion_limit(limits.recursion)
        .token_limit(limits.tokens)
        .parse();
    if let Some(error) = tree.errors().next() {
        return Err(format!(
            "the document does not parse: {} (at byte {})",
            error.message(),
            error.index()
        ));
    }
    let mut operations = Vec::new();
    let mut fragments = BTreeMap::new();
    for definition in tree.document().definitions() {
        match definition {
            cst::Definition::OperationDefinition(op) => operations.push(op),
            cst::Definition::FragmentDefinition(f) => {
                if let Some(name) = f.fragment_name().and_then(|n| n.name()) {
                    fragments.insert(name.text().to_string(), f);
                }
            }
            // Type system definitions are no executable document's: the
            // service refuses them, and nothing runs.
            _ => return Err("the document defines types; a request's document holds operations and fragments only".to_owned()),
        }
    }
    let operation_name = |op: &cst::OperationDefinition| op.name().map(|n| n.text().to_string());
    let op = match name {
        Some(wanted) => operations
            .into_iter()
            .find(|op| operation_name(op).as_deref() == Some(wanted))
            .ok_or_else(|| format!("the document has no operation named {wanted:?}"))?,
        None => {
            let mut ops = operations.into_iter();
            match (ops.next(), ops.next()) {
                (Some(op), None) => op,
                (None, _) => return Err("the document has no operation".to_owned()),
                (Some(_), Some(_)) => {
                    return Err(
                        "the document has several operations; operationName selects one".to_owned(),
                    );
                }
            }
        }
    };
    let kind = match op.operation_type() {
        None => OperationType::Query,
        Some(t) if t.mutation_token().is_some() => OperationType::Mutation,
        Some(t) if t.subscription_token().is_some() => OperationType::Subscription,
        Some(_) => OperationType::Query,
    };
    // The operation's tokens, then those of the fragments it spreads
    // (and they spread), each once, by name. The tree only says where
    // each definition is: its text is lexed again, which costs a
    // fraction of walking the tree's tokens.
    let mut normal = String::with_capacity(query.len());
    let mut pending = tokens(slice(query, op.syntax()), &mut normal);
    let mut used = BTreeSet::new();
    while let Some(next) = pending.pop() {
        if used.insert(next.clone())
            && let Some(f) = fragments.get(&next)
        {
            pending.extend(tokens(slice(query, f.syntax()), &mut normal));
        }
    }
    Ok(Selected {
        kind,
        name: operation_name(&op),
        normal,
    })
}

/// The text of the definition `node` in `query`.
fn slice<'q>(query: &'q str, node: &apollo_parser::SyntaxNode) -> &'q str {
    let range = node.text_range();
    query
        .get(usize::from(range.start())..usize::from(range.end()))
        .unwrap_or("")
}

/// Appends the significant tokens of `text` to `out`, one space apart,
/// and returns the names of the fragments it spreads (`...Name`, not an
/// inline `... on Type`).
fn tokens(text: &str, out: &mut String) -> Vec<String> {
    let mut spreads = Vec::new();
    let mut after_spread = false;
    for token in Lexer::new(text).flatten() {
        let kind = token.kind();
        if matches!(
            kind,
            TokenKind::Whitespace | TokenKind::Comment | TokenKind::Comma | TokenKind::Eof
        ) {
            continue;
        }
        if after_spread && kind == TokenKind::Name && token.data() != "on" {
            spreads.push(token.data().to_owned());
        }
        after_spread = kind == TokenKind::Spread;
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(token.data());
    }
    spreads
}
