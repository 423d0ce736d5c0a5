//! [`AccountLayer`]: wraps a service in the account stage.

use std::sync::Arc;

use tower::Layer;

use super::{Account, Accounts};

/// Accounts for requests in one [`Accounts`].
#[derive(Clone)]
pub struct AccountLayer {
    accounts: Arc<Accounts>,
}

impl AccountLayer {
    /// An account stage that writes to `accounts`.
    #[inline]
    pub(in crate::pipeline) fn new(accounts: Arc<Accounts>) -> Self {
        AccountLayer { accounts }
    }
}

impl<S> Layer<S> for AccountLayer {
    type Service = Account<S>;
    fn layer(&self, inner: S) -> Account<S> {
        Account::new(inner, self.accounts.clone())
    }
}
